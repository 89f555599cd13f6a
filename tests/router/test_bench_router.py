"""``kvatlas bench router`` runs end to end on small sizes: every request it times was routed
with a score — from the coordinator over HTTP, or from the router's own replica — (no score
failure), and it prints every row it promises for each scoring mode — the open-loop row at an
offered rate, then the closed-loop ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvatlas.bench import router
from kvatlas.cli import _build_parser as build_parser


def test_bench_router_scores_every_request(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", "router", "--chunks", "800", "--prompt-tokens", "1024", "--seconds", "0.5",
            "--ttft-requests", "8", "--clients", "2", "--rate", "40", "--json", str(out)]  # fmt: skip
    assert router.run(build_parser().parse_args(argv)) == 0
    rows = json.loads(out.read_text())["rows"]
    cases = [r["case"] for r in rows]
    assert sum("route decision" in c for c in cases) == 6
    for first, mode in ((0, "http"), (3, "replica")):  # the same rows for each scoring mode
        assert all(f"scores from {mode}," in c for c in cases[first : first + 3])
        assert "open loop, Poisson arrivals at 40 req/s" in cases[first]
        assert rows[first]["target"] == "p99 ≤ 5 ms at 40 req/s"
        assert "closed loop, 2 connection(s)" in cases[first + 1]
    assert any("--policy kvatlas (score from http + proxy)" in c for c in cases)
    assert any("--policy kvatlas (score from replica + proxy)" in c for c in cases)
    assert any("--policy round-robin (proxy alone)" in c for c in cases)
    for row in rows[:6]:
        assert row["extra"]["score_failures"] == "0"
        assert float(row["extra"]["req_per_s"].replace(",", "")) > 0
        assert float(row["extra"]["router_cpu_per_req_ms"]) > 0
        assert float(row["extra"]["decision_p99_ms"]) <= float(row["extra"]["decision_p99_le_ms"])
    for row in rows[:3]:  # over HTTP the coordinator scores
        assert float(row["extra"]["coordinator_cpu_per_req_ms"]) > 0


def test_decision_quantiles_and_failures_come_from_the_prometheus_parser() -> None:
    """The bench reads the router's ``/metrics`` with prometheus_client's parser: bucket
    bounds (``+Inf`` included), the quantile's bucket between two scrapes, a counter."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    registry = CollectorRegistry()
    name = "kvatlas_router_decision_seconds"
    decisions = Histogram(name, "d", buckets=(0.001, 0.005, 0.01), registry=registry)
    failures = Counter("kvatlas_router_score_failures", "f", registry=registry)
    decisions.observe(0.0005)
    before = generate_latest(registry).decode()
    for seconds in (0.0005, 0.0005, *[0.004] * 7, 0.02):
        decisions.observe(seconds)
    failures.inc(3)
    after = generate_latest(registry).decode()
    inf = float("inf")
    assert router._histogram(after, name) == [
        (0.001, 3.0),
        (0.005, 10.0),
        (0.01, 10.0),
        (inf, 11.0),
    ]
    assert router._quantile_bound(before, after, name, 0.5) == 0.005
    assert router._quantile_bound(before, after, name, 0.99) == inf
    # interpolated inside the bucket (histogram_quantile): of the 10 observed in between, the
    # 5th is the 3rd of the 7 in (1 ms, 5 ms]; +Inf gives the last finite bound
    assert router._quantile(before, after, name, 0.5) == pytest.approx(0.001 + 0.004 * 3 / 7)
    assert router._quantile(before, after, name, 0.2) == pytest.approx(0.001)
    assert router._quantile(before, after, name, 0.99) == 0.01
    assert router._mean(before, after, name) == pytest.approx((0.001 + 0.028 + 0.02) / 10)
    assert [s.value for s in router._samples(after, "kvatlas_router_score_failures_total")] == [3.0]


def test_open_loop_offers_its_rate_whatever_the_replies_take() -> None:
    """Open loop: requests leave on their Poisson schedule, not when the last one is answered
    — a server slower than the gaps gets more than one request at once, and each latency runs
    from its scheduled arrival (a late reply is not hidden by a later send)."""
    import asyncio
    import threading

    from kvatlas.bench.loadgen import build_post, poisson_arrivals, run_open_loop

    arrivals = poisson_arrivals(50.0, 1.0, seed=3)
    assert arrivals == poisson_arrivals(50.0, 1.0, seed=3)  # same seed, same schedule
    assert 25 < len(arrivals) < 80 and all(0 <= t < 1.0 for t in arrivals)
    concurrent = {"now": 0, "most": 0}
    ready = threading.Event()
    port: list[int] = []

    async def serve() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                concurrent["now"] += 1
                concurrent["most"] = max(concurrent["most"], concurrent["now"])
                await asyncio.sleep(0.1)  # slower than the mean gap of 20 ms
                concurrent["now"] -= 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        await asyncio.sleep(5)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    ready.wait(5)
    request = build_post("127.0.0.1", port[0], "/", b"{}")
    latencies, _late = run_open_loop("127.0.0.1", port[0], [request], arrivals, 16)
    assert len(latencies) == len(arrivals)
    assert concurrent["most"] >= 3  # a closed loop on one connection would never overlap
    assert min(latencies) >= 0.1
