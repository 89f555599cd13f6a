"""The node's hot routes over loopback HTTP, two source trees side by side: ``POST
/engine/lookup``, ``/engine/store``, ``/engine/retrieve`` (msgpack, as ``EngineClient`` sends
them) and ``POST /peer/kv`` (4 keys), the workload of ``bench_node_asgi.py`` (distinct prompts,
token ids from a 128k-id vocabulary; an L1 of 64 chunks, 16 of them pinned, so every store
inserts and evicts; reads hit). One ``kvatlas node`` process per tree, both up at once, and one
coordinator (the first tree's) whose pins they poll; rounds interleave the trees (tree A's ops,
then tree B's), so a busy machine slows both alike. Reports, per tree and op, the median over
rounds of the server process's CPU time per request (utime + stime, every thread) and of the
client's median latency.

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
from bench_node_asgi import (  # this script's own folder
    DIM,
    HEADS,
    L1_BYTES,
    L1_CHUNKS,
    LAYERS,
    OPS,
    PINNED_PROMPTS,
    C,
    Call,
    Workload,
)

from kvatlas.asgi_thread import free_port
from kvatlas.bench.server_cpu import process_cpu_seconds

MODEL = ["--model-name", "toy", "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS),
         "--head-dim", str(DIM), "--chunk-size", str(C), "--dtype", "float16", "--l2", "none",
         "--l1-bytes", str(L1_BYTES), "--pin-refresh-interval-s", "0.2",
         "--log-level", "warning"]  # fmt: skip


def start(tree: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """``kvatlas <args>`` from ``tree`` on a free port, once ``/healthz`` answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    argv = [sys.executable, "-m", "kvatlas.cli", *args, "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{args[0]} from {tree} did not come up")


def run(client: httpx.Client, pid: int, calls: list[Call]) -> tuple[float, float]:
    """(server CPU seconds per request, median client latency) of ``calls``."""
    latencies = []
    cpu0 = process_cpu_seconds(pid)
    for path, body, headers in calls:
        sent = {k.decode(): v.decode() for k, v in headers}
        t0 = time.perf_counter()
        r = client.post(path, content=body, headers=sent)
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200, (path, r.status_code, r.content[:200])
    return (process_cpu_seconds(pid) - cpu0) / len(calls), statistics.median(latencies)


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} ") or line.startswith(f"{name}_total "):
            return float(line.split()[1])
    raise RuntimeError(f"no {name} in the node's metrics")


def pin(coordinator: str, work: Workload, clients: dict[str, httpx.Client]) -> None:
    """Pin the workload's pinned prompts and wait until every node polled them."""
    for tokens in work.pinned:
        body = {"model_name": "toy", "world_size": 1, "token_ids": tokens.tolist()}
        httpx.post(f"{coordinator}/cache/pins", json=body, timeout=30).raise_for_status()
    want = PINNED_PROMPTS * len(work.pinned[0]) // C
    for _ in range(600):
        if all(metric(c, "kvatlas_node_pinned_keys") == want for c in clients.values()):
            return
        time.sleep(0.1)
    raise RuntimeError("the nodes never learned their pins")


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
    coordinator, coord_url = start(trees[0][1], "coordinator", "--chunk-size", str(C),
                                   "--log-level", "warning")  # fmt: skip
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    lat: dict[tuple[str, str], list[float]] = {}
    try:
        for name, tree in trees:
            procs[name] = start(tree, "node", *MODEL, "--instance-id", f"bench-{name}",
                                "--coordinator-url", coord_url)  # fmt: skip
        clients = {name: httpx.Client(base_url=url, timeout=30) for name, (_, url) in procs.items()}
        work = {name: Workload() for name, _ in trees}
        pin(coord_url, work[trees[0][0]], clients)
        for name, _ in trees:  # the pinned prompts and the first ones reads go to
            run(clients[name], procs[name][0].pid, work[name].setup())
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for name, _ in order:
                for op in OPS:
                    calls = [work[name].call(op) for _ in range(args.requests)]
                    c, lt = run(clients[name], procs[name][0].pid, calls)
                    cpu.setdefault((name, op), []).append(c)
                    lat.setdefault((name, op), []).append(lt)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        for name, client in clients.items():  # every store evicted; the pins held
            evictions = metric(client, "kvatlas_node_l1_evictions")
            stores = args.rounds * args.requests
            assert evictions >= 4 * stores - L1_CHUNKS, (name, evictions)
            assert metric(client, "kvatlas_node_l1_chunks") == L1_CHUNKS
    finally:
        for proc, _ in [*procs.values(), (coordinator, coord_url)]:
            proc.terminate()
            proc.wait(30)
    print(f"{'op':12} {'tree':8} {'server CPU/op':>14} {'p50 latency':>12}  (medians of "
          f"{args.rounds} rounds x {args.requests} requests)")  # fmt: skip
    first = trees[0][0]
    for op in OPS:
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
