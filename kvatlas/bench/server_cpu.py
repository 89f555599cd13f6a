"""The server's own CPU time (utime + stime of its process, all threads) and the C load
generator ``wrk`` with a fallback: what ``bench service`` measures a service with.

The load generator shares the machine's cores with the server, so requests/s says as much about
the client as about the server; CPU seconds of the server process per operation do not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvatlas.bench.loadgen import poisson_arrivals, run_load, run_open_loop

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` from field 3 (``state``) on: ``[i]`` is field
    ``i + 3`` of proc(5)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses


def process_cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far, every thread (exited ones too), to the nanosecond:
    its CPU-time clock (``clock_getcpuclockid(3)``). ``/proc/<pid>/stat``'s utime + stime, the
    fallback, count clock ticks (10 ms): a short run's CPU could read 0."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # the kernel's MAKE_PROCESS_CPUCLOCK
    except OSError:
        fields = _stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / _TICKS  # fields 14 and 15 of proc(5)


def process_minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (``minflt``, field 10 of proc(5)): each
    first touch of a fresh page, which costs kernel time apiece."""
    return int(_stat_fields(pid)[7])


def process_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS`` of ``/proc/<pid>/status``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass(frozen=True)
class LoadResult:
    requests: int
    seconds: float
    p50_s: float
    p99_s: float
    server_cpu_s: float
    generator: str  # "wrk" or "python"

    @property
    def per_request_cpu_s(self) -> float:
        return self.server_cpu_s / max(1, self.requests)


_WRK_SCRIPT = """
local bodies = {}
for line in io.lines("%(bodies)s") do bodies[#bodies + 1] = line end
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i + 1
  return wrk.format(nil, "%(path)s", nil, bodies[(i %% #bodies) + 1])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVATLAS %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    math.floor(latency:percentile(50)), math.floor(latency:percentile(99)), e.status + e.connect + e.read + e.write + e.timeout))
end
"""
_RESULT = re.compile(r"^KVATLAS (\d+) (\d+) (\d+) (\d+) (\d+)$", re.M)


def wrk_path() -> str | None:
    return shutil.which("wrk")


def wrk_command(wrk: str, connections: int, seconds: float, script: Path, url: str) -> list[str]:
    """2 threads (one where there is one connection: wrk refuses more threads than
    connections), ``connections`` connections, whole seconds (at least 1)."""
    threads = max(1, min(2, connections))
    duration = max(1, round(seconds))
    return [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration}s", "-s", str(script), url]


def run_wrk(
    url: str, path: str, bodies: list[bytes], connections: int, seconds: float, pid: int
) -> LoadResult:
    """``wrk`` (:func:`wrk_command`: ``connections`` connections) posting ``bodies`` round
    robin."""
    wrk = wrk_path()
    if wrk is None:
        raise RuntimeError("wrk is not installed")
    if any(b"\n" in body for body in bodies):
        raise ValueError("wrk bodies are read one per line: a body holds a newline")
    with tempfile.TemporaryDirectory() as tmp:
        body_file = Path(tmp) / "bodies.txt"
        body_file.write_bytes(b"\n".join(bodies) + b"\n")
        script = Path(tmp) / "post.lua"
        script.write_text(_WRK_SCRIPT % {"bodies": body_file, "path": path})
        cpu0 = process_cpu_seconds(pid)
        done = subprocess.run(
            wrk_command(wrk, connections, seconds, script, url),
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        cpu = process_cpu_seconds(pid) - cpu0
    out = done.stdout
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr or out}")
    match = _RESULT.search(out)
    if match is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    requests, duration_us, p50_us, p99_us, errors = map(int, match.groups())
    if errors:
        raise RuntimeError(f"wrk saw {errors} errors (non-2xx, connect, read, write, timeout)")
    return LoadResult(requests, duration_us / 1e6, p50_us / 1e6, p99_us / 1e6, cpu, "wrk")


def run_python_load(
    host: str, port: int, requests: list[bytes], clients: int, seconds: float, pid: int
) -> LoadResult:
    """The Python load generator (``loadgen``), the fallback without ``wrk``."""
    cpu0 = process_cpu_seconds(pid)
    latencies = sorted(run_load(host, port, requests, clients, seconds))
    cpu = process_cpu_seconds(pid) - cpu0
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return LoadResult(len(latencies), seconds, p50, p99, cpu, "python")


def run_python_open_loop(
    host: str,
    port: int,
    requests: list[bytes],
    rate: float,
    seconds: float,
    pid: int,
    *,
    connections: int = 64,
    seed: int = 0,
) -> tuple[LoadResult, int]:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (``loadgen.run_open_loop``):
    the load and how many requests the generator sent more than 1 ms late."""
    arrivals = poisson_arrivals(rate, seconds, seed)
    cpu0 = process_cpu_seconds(pid)
    latencies, late = run_open_loop(host, port, requests, arrivals, connections)
    cpu = process_cpu_seconds(pid) - cpu0
    latencies.sort()
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    result = LoadResult(len(latencies), seconds, p50, p99, cpu, "python, open loop")
    return result, late


def warn_no_wrk() -> None:
    print(
        "warning: wrk not found (make bench installs it): lookups use the Python load "
        "generator, which takes more of the shared CPU from the server",
        file=sys.stderr,
    )
