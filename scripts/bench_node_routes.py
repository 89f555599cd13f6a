"""The node's hot routes over loopback HTTP, two source trees side by side: ``POST
/engine/lookup``, ``/engine/store``, ``/engine/retrieve`` (msgpack, as ``EngineClient`` sends
them) and ``POST /peer/kv`` (4 keys). One ``kvatlas node`` process per tree, both up at once;
rounds interleave the trees (tree A's ops, then tree B's), so a busy machine slows both alike.
Reports, per tree and op, the median over rounds of the server process's CPU time per request
(utime + stime, every thread) and of the client's median latency.

    python scripts/bench_node_routes.py --tree base=/tmp/base --tree branch=. --rounds 7

On a loaded machine the server's CPU per request over HTTP varies by ±20% from run to run;
``--asgi`` measures the request stack and handlers alone instead (the node's app called
in-process over ASGI, ``scripts/bench_node_asgi.py``, one process per tree and round,
alternating).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_node_asgi import DIM, HEADS, LAYERS, C, operations  # this script's own folder

from kvatlas.asgi_thread import free_port
from kvatlas.bench.server_cpu import process_cpu_seconds

MODEL = ["--model-name", "toy", "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS),
         "--head-dim", str(DIM), "--chunk-size", str(C), "--dtype", "float16", "--l2", "none",
         "--log-level", "warning"]  # fmt: skip


def start(tree: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    args = [sys.executable, "-m", "kvatlas.cli", "node", *MODEL, "--port", str(port)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"node from {tree} did not come up")


def bodies() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """The calls of ``bench_node_asgi.py``, with their headers as a dict (httpx's form)."""
    return {
        op: (path, body, {k.decode(): v.decode() for k, v in headers})
        for op, (path, body, headers) in operations().items()
    }


def run(client: httpx.Client, pid: int, path: str, body: bytes, headers: dict[str, str],
        n: int) -> tuple[float, float]:  # fmt: skip
    """(server CPU seconds per request, median client latency) of ``n`` requests."""
    latencies = []
    cpu0 = process_cpu_seconds(pid)
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(path, content=body, headers=headers)
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200, (path, r.status_code, r.content[:200])
    return (process_cpu_seconds(pid) - cpu0) / n, statistics.median(latencies)


def asgi(trees: list[tuple[str, Path]], rounds: int, requests: int) -> int:
    """``--asgi``: per round and tree, ``bench_node_asgi.py`` in a process of its own."""
    script = Path(__file__).with_name("bench_node_asgi.py")
    cpu: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
            out = subprocess.run(
                [sys.executable, str(script), "--requests", str(requests), "--rounds", "3"],
                env=env, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            for line in out.splitlines():
                op, micros = line.split()
                cpu.setdefault((name, op), []).append(float(micros))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    print(f"{'op':12} {'tree':8} {'CPU/op':>10}  (in-process ASGI, medians of {rounds} rounds)")
    for op in dict.fromkeys(op for _, op in cpu):
        for name, _ in trees:
            print(f"{op:12} {name:8} {statistics.median(cpu[name, op]):7.1f} µs")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--asgi", action="store_true", help="the app in-process, no HTTP server")
    args = parser.parse_args()
    trees = [(n, Path(p)) for n, _, p in (t.partition("=") for t in args.tree)]
    if args.asgi:
        return asgi(trees, args.rounds, args.requests)
    procs = {name: start(tree) for name, tree in trees}
    ops = bodies()
    cpu: dict[tuple[str, str], list[float]] = {}
    lat: dict[tuple[str, str], list[float]] = {}
    try:
        clients = {name: httpx.Client(base_url=url, timeout=30) for name, (_, url) in procs.items()}
        for name, _ in trees:  # stored once: lookups and retrievals hit, fetches find the keys
            path, body, headers = ops["store"]
            run(clients[name], procs[name][0].pid, path, body, headers, 50)
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for name, _ in order:
                for op, (path, body, headers) in ops.items():
                    c, lt = run(clients[name], procs[name][0].pid, path, body, headers,
                                args.requests)  # fmt: skip
                    cpu.setdefault((name, op), []).append(c)
                    lat.setdefault((name, op), []).append(lt)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(30)
    print(f"{'op':12} {'tree':8} {'server CPU/op':>14} {'p50 latency':>12}  (medians of "
          f"{args.rounds} rounds x {args.requests} requests)")  # fmt: skip
    first = trees[0][0]
    for op in ops:
        for name, _ in trees:
            c = statistics.median(cpu[name, op]) * 1e6
            lt = statistics.median(lat[name, op]) * 1e6
            ratio = ""
            if name != first:  # per round, against the first tree's run of the same round
                paired = [b / a for a, b in zip(cpu[first, op], cpu[name, op], strict=True)]
                ratio = f"  CPU x{statistics.median(paired):.2f} of {first} (median of rounds)"
            print(f"{op:12} {name:8} {c:11.1f} µs {lt:9.1f} µs{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
