"""One restore as a coordinator's start does it, in a process of its own.

``python -m kvatlas.bench.restore_probe PATH CHUNK_SIZE on|off`` warms the compiled kernels
(as the coordinator does before it restores), restores the snapshot at ``PATH`` into a fresh
directory and prints ``{"seconds", "cpu_s", "keys"}`` as JSON. A restore in the benchmark's
own process would reuse the memory of the directories it freed before, and fault no page in
for the contents; a coordinator's start faults every one in (docs/performance.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from kvatlas.directory import KeyDirectory, load_snapshot, warm_up_kernels


def restore_in_fresh_process(path: Path, chunk_size: int, blend: bool) -> tuple[float, float, int]:
    """The restore's seconds, process CPU and keys restored, in a process of its own."""
    argv = [sys.executable, "-m", __name__, str(path), str(chunk_size), "on" if blend else "off"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"restore probe failed ({done.returncode}): {done.stderr.strip()}")
    out = json.loads(done.stdout)
    return float(out["seconds"]), float(out["cpu_s"]), int(out["keys"])


def main(argv: list[str]) -> None:
    path, chunk_size, blend = argv
    warm_up_kernels()
    directory = KeyDirectory(int(chunk_size), enable_blend_lookup=blend == "on")
    cpu = time.process_time()
    info = load_snapshot(directory, path)
    cpu_s = time.process_time() - cpu
    print(json.dumps({"seconds": info.seconds, "cpu_s": cpu_s, "keys": info.keys}))


if __name__ == "__main__":
    main(sys.argv[1:])
