"""``bench blend``'s warm-up compiles what its timed rows call: a kernel compiled (or loaded from
numba's cache) inside a timed row is timed as if it were the index's work."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys

import numpy as np
from numba.core.dispatcher import Dispatcher
from rich.progress import Progress

from kvatlas.bench import blend
from kvatlas.workloads import LLAMA2, LLAMA3


def specialisations():
    seen = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("kvatlas"):
            for attr, value in list(vars(module).items()):
                if isinstance(value, Dispatcher):
                    seen[f"{name}.{attr}"] = len(value.signatures)
    return seen


blend._warm_up()
before = specialisations()
failures = []
with Progress(disable=True) as progress:
    for vocab in (LLAMA3, LLAMA2):
        rng = np.random.default_rng(1)
        blend._bench_size(3000, [4096], 1, rng, 3000, progress, failures, vocab)
after = specialisations()
assert not failures, failures
print(sorted(k for k, n in after.items() if n > before.get(k, 0)))
"""


def test_no_kernel_is_compiled_inside_a_timed_row() -> None:
    """With the warm-up of a few uint32 writes, 17 kernels were first called after it (the
    index's growth, the batch writes, the token storage's, the naive reference's): on a cold
    kernel cache, the build (``add N=20,000``, one pass) read 21.2 µs a chunk against 4.0."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=600
    ).stdout
    assert out.strip().splitlines()[-1] == "[]", out
