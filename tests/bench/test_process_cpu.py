"""A process's CPU time as the benches read it (``server_cpu.process_cpu_seconds``): to the
nanosecond, so a short run's few milliseconds do not read 0 (``/proc/<pid>/stat`` counts
10 ms ticks: `bench router`'s quick run once read a router's CPU a request as 0.000 ms)."""

from __future__ import annotations

import subprocess
import sys

from kvatlas.bench.server_cpu import process_cpu_seconds

SPIN = """
import sys, time
start = time.process_time()
while time.process_time() - start < 0.004:  # 4 ms of its own CPU, under one clock tick
    pass
print(time.process_time(), flush=True)
sys.stdin.read()  # until the test has read its clock
"""


def test_a_few_milliseconds_of_another_process_are_counted() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        own = float(child.stdout.readline())  # the CPU the child counted itself, at its end
        measured = process_cpu_seconds(child.pid)
    finally:
        child.communicate("")
    assert measured >= own >= 0.004  # every thread since its start: the interpreter's too
