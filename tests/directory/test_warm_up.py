"""``warm_up_kernels`` loads every compiled write path of the blend index before serving."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
from kvatlas.directory import warm_up_kernels
from kvatlas.directory.blend.kernels import objects, writes
warm_up_kernels()
cold = [k.__name__ for k in (writes.apply_op, writes.apply_ops, objects.kept_arrays,
        objects.hash_lengths) if not k.signatures]
print(cold)
"""


def test_warm_up_loads_every_write_kernel() -> None:
    """In a fresh process (in this one, other tests may have compiled them already)."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=600
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
