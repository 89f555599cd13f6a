"""``warm_up_kernels`` loads the compiled write paths of the blend index, the match and the JSON
decoder (each with its GIL-releasing twin for long calls) before serving."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
from kvatlas.directory import warm_up_kernels
from kvatlas.directory.blend import kernels
from kvatlas.directory.blend.kernels import objects, writes
from kvatlas.events import _json_cut, _json_tokens
warm_up_kernels()
cold = [k.__name__ for k in (writes.apply_op, writes.apply_ops, objects.kept_arrays,
        objects.hash_lengths, writes.apply_ops_releasing, kernels.scan, kernels.scan_releasing,
        _json_cut._cut, _json_cut._cut_releasing, _json_tokens._parse_lists,
        _json_tokens._parse_lists_releasing) if not k.signatures]
print(cold)
"""


def test_warm_up_loads_every_write_kernel_and_the_releasing_twins() -> None:
    """In a fresh process (in this one, other tests may have compiled them already)."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=600
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
