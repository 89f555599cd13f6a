"""One restore as a coordinator's start does it, in a process of its own.

``python -m kvatlas.bench.restore_probe PATH CHUNK_SIZE on|off`` warms the compiled kernels
(as the coordinator does before it restores), restores the snapshot at ``PATH`` into a fresh
directory, makes one blend lookup (blend on) and prints ``{"seconds", "cpu_s", "keys",
"first_lookup_s"}`` as JSON: what a restore leaves to the first lookup (anchoring every content
when the snapshot saved no anchors) shows there. A restore in the benchmark's
own process would reuse the memory of the directories it freed before, and fault no page in
for the contents; a coordinator's start faults every one in (docs/performance.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvatlas.bench.directory_workload import MODEL
from kvatlas.coordinator.runtime import freeze_long_lived
from kvatlas.directory import KeyDirectory, load_snapshot, warm_up_kernels
from kvatlas.keys import BlendNamespace
from kvatlas.workloads import LLAMA3, random_token_ids


def restore_in_fresh_process(
    path: Path, chunk_size: int, blend: bool
) -> tuple[float, float, int, float | None]:
    """The restore's seconds, process CPU and keys restored, in a process of its own, and the
    seconds of the first blend lookup after it (``None``: blend off)."""
    argv = [sys.executable, "-m", __name__, str(path), str(chunk_size), "on" if blend else "off"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"restore probe failed ({done.returncode}): {done.stderr.strip()}")
    out = json.loads(done.stdout)
    first = out["first_lookup_s"]
    return float(out["seconds"]), float(out["cpu_s"]), int(out["keys"]), first


def main(argv: list[str]) -> None:
    path, chunk_size, blend = argv
    warm_up_kernels()
    directory = KeyDirectory(int(chunk_size), enable_blend_lookup=blend == "on")
    cpu = time.process_time()
    info = load_snapshot(directory, path)
    cpu_s = time.process_time() - cpu
    first = None
    if blend == "on":
        freeze_long_lived()  # as a coordinator before its first request (else a collection)
        query = random_token_ids(np.random.default_rng(0), 32_768, LLAMA3)  # (as bench service's)
        started = time.perf_counter()
        directory.blend_match(query, BlendNamespace(MODEL, "", 1))  # (the workload's)
        first = time.perf_counter() - started
    out = {"seconds": info.seconds, "cpu_s": cpu_s, "keys": info.keys, "first_lookup_s": first}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
