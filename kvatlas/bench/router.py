"""The router's own cost (``kvatlas router``): route decision latency (score + choice) under
load, the router process's CPU per request, and the time to first token it adds against
calling the engine directly.

Real processes on loopback: a redis-server, a coordinator on the Redis transport holding a
RAG-style directory (``bench route``'s workload, the engines as its instances, fed through the
stream), the router in two scoring modes — ``--scores-from http`` (one ``POST /route/score``
to the coordinator per request) and ``--scores-from replica`` (a coordinator replica in the
router's process, reading the same stream: a function call per request) — a round-robin router
(the proxy alone) and one constant-reply engine serving every engine id. The engine is
deliberately not a simulator: it answers at once, so what is timed is the router.
The target's "at 500 requests/s" is an offered rate, so the first row is open loop: Poisson
arrivals at ``--rate`` whether or not earlier requests were answered; closed-loop rows
(``--clients`` connections, then one) follow. Decision latency is read from the router's own
histogram (``kvatlas_router_decision_seconds``: body read, tokens, score, choice; buckets every
0.25 ms up to 5 ms), interpolated inside its bucket, with the bucket's bound beside it (the
verdict uses the bound). CPU per request is measured for every process — the router (with a
replica: router and scoring both), the coordinator, the engine, and this process (the load
generator) — from ``/proc/<pid>/stat``, and every row gives the machine's load average. The added TTFT is the
difference of medians of time-to-first-byte, direct and routed requests alternating so drift
hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich.progress import Progress

from kvatlas.asgi_thread import free_port
from kvatlas.bench.common import BenchRow, add_common_arguments, report
from kvatlas.bench.loadgen import build_post
from kvatlas.bench.route import CHUNK, MODEL, build_query, build_workload
from kvatlas.bench.server_cpu import (
    LoadResult,
    process_cpu_seconds,
    run_python_load,
    run_python_open_loop,
    run_wrk,
    warn_no_wrk,
    wrk_path,
)
from kvatlas.processes import spawn_service, spawn_services, stop

ENGINES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=1)
    parser.add_argument("--chunks", type=int, default=20_000, help="chunks in the directory")
    parser.add_argument("--prompt-tokens", type=int, default=4_096, help="tokens per prompt")
    parser.add_argument("--rate", type=float, default=500.0,
                        help="open-loop offered rate, requests/s (Poisson arrivals)")  # fmt: skip
    parser.add_argument("--open-connections", type=int, default=64,
                        help="connections the open-loop generator may use at once")  # fmt: skip
    parser.add_argument("--clients", type=int, default=8,
                        help="connections of the closed-loop row")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of the load")
    parser.add_argument("--ttft-requests", type=int, default=300,
                        help="sequential requests each way for the added TTFT")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")


def _echo_app() -> Any:
    """A vLLM-shaped engine that answers at once (one SSE event for a stream)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    reply = {"id": "cmpl-0", "object": "text_completion", "model": MODEL,
             "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                       "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip

    async def completions(request: Any) -> Response:
        body = json.loads(await request.body())
        if body.get("stream"):

            async def events() -> Any:
                yield b'data: {"id":"cmpl-0","choices":[{"index":0,"text":"x"}]}\n\n'
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(reply)

    async def models(_: Any) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "max_model_len": 1 << 20}]})

    async def ok(_: Any) -> Response:
        return Response(status_code=200)

    async def metrics(_: Any) -> Response:
        return PlainTextResponse("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models), Route("/health", ok), Route("/healthz", ok),
        Route("/metrics", metrics),
    ])  # fmt: skip


def serve_echo_engine(port: int) -> None:
    """``python -c 'from kvatlas.bench.router import serve_echo_engine; ...'``."""
    from kvatlas.asgi_thread import serve

    serve(_echo_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _samples(text: str, name: str) -> list[Sample]:
    """The samples named ``name`` (e.g. ``x_bucket``, ``x_total``) of a Prometheus text
    exposition, read by prometheus_client's parser."""
    return [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def _histogram(text: str, name: str) -> list[tuple[float, float]]:
    """``(le, cumulative count)`` of a Prometheus histogram's buckets (``+Inf`` is ``inf``)."""
    return [(float(s.labels["le"]), s.value) for s in _samples(text, f"{name}_bucket")]


def _delta(before: str, after: str, name: str) -> list[tuple[float, float]]:
    """The buckets of what was observed between two scrapes."""
    then = dict(_histogram(before, name))
    return [(le, count - then.get(le, 0.0)) for le, count in _histogram(after, name)]


def _quantile_bound(before: str, after: str, name: str, q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of what was observed in between."""
    buckets = _delta(before, after, name)
    for le, count in buckets:
        if count >= q * buckets[-1][1]:
            return le
    return float("inf")


def _quantile(before: str, after: str, name: str, q: float) -> float:
    """Quantile ``q`` of what was observed in between, interpolated linearly inside its bucket
    (Prometheus's ``histogram_quantile``; the first bucket starts at 0, ``+Inf`` gives the
    last finite bound)."""
    buckets = _delta(before, after, name)
    rank = q * buckets[-1][1]
    low, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if le == float("inf"):
                return low
            return low + (le - low) * (rank - below) / (count - below)
        low, below = le, count
    return float("inf")


def _mean(before: str, after: str, name: str) -> float:
    """The mean of what was observed in between (``_sum`` ÷ ``_count``)."""

    def total(text: str, suffix: str) -> float:
        return sum(s.value for s in _samples(text, f"{name}{suffix}"))

    count = total(after, "_count") - total(before, "_count")
    return (total(after, "_sum") - total(before, "_sum")) / count if count else float("nan")


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _first_byte_s(client: httpx.Client, url: str, body: bytes) -> float:
    start = time.perf_counter()
    with client.stream("POST", url, content=body,
                       headers={"content-type": "application/json"}) as reply:  # fmt: skip
        chunks = reply.iter_raw()
        next(chunks)
        elapsed = time.perf_counter() - start
        for _ in chunks:  # the rest, so the connection is reused
            pass
    return elapsed


def _load(args: argparse.Namespace, port: int, pid: int, bodies: list[bytes],
          clients: int) -> LoadResult:  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    if wrk_path() is not None:
        return run_wrk(url, "/v1/completions", bodies, clients, args.seconds, pid)
    requests = [build_post("127.0.0.1", port, "/v1/completions", b) for b in bodies]
    return run_python_load("127.0.0.1", port, requests, clients, args.seconds, pid)


def _decision_row(args: argparse.Namespace, client: httpx.Client, port: int, mode: str,
                  pids: tuple[int, int, int], bodies: list[bytes],
                  clients: int | None) -> BenchRow:  # fmt: skip
    """Load on a kvatlas router scoring from ``mode`` — open loop at ``args.rate``
    (``clients`` None) or closed loop on ``clients`` connections; the decision quantiles from
    its histogram, in between, and the CPU the router, the coordinator, the engine (``pids``)
    and this process (the load generator) spent per request."""
    url = f"http://127.0.0.1:{port}"
    router_pid, coordinator_pid, engine_pid = pids
    before = client.get(f"{url}/metrics").text
    coordinator_cpu = process_cpu_seconds(coordinator_pid)
    engine_cpu = process_cpu_seconds(engine_pid)
    generator_cpu = process_cpu_seconds(os.getpid())
    late = 0
    if clients is None:
        requests = [build_post("127.0.0.1", port, "/v1/completions", b) for b in bodies]
        load, late = run_python_open_loop(
            "127.0.0.1", port, requests, args.rate, args.seconds, router_pid,
            connections=args.open_connections, seed=args.seed,
        )  # fmt: skip
        how = f"open loop, Poisson arrivals at {args.rate:g} req/s"
    else:
        load = _load(args, port, router_pid, bodies, clients)
        how = f"closed loop, {clients} connection(s)"
    coordinator_cpu = process_cpu_seconds(coordinator_pid) - coordinator_cpu
    engine_cpu = process_cpu_seconds(engine_pid) - engine_cpu
    generator_cpu = process_cpu_seconds(os.getpid()) - generator_cpu
    after = client.get(f"{url}/metrics").text
    failures = sum(s.value for s in _samples(after, "kvatlas_router_score_failures_total"))
    failures -= sum(s.value for s in _samples(before, "kvatlas_router_score_failures_total"))
    rate = load.requests / load.seconds
    name = "kvatlas_router_decision_seconds"
    p50, p99 = (_quantile(before, after, name, q) for q in (0.5, 0.99))
    p50_le, p99_le = (_quantile_bound(before, after, name, q) for q in (0.5, 0.99))
    extra = {
        "req_per_s": f"{rate:,.0f}",
        "decision_p50_ms": f"{p50 * 1e3:.2f}", "decision_p50_le_ms": f"{p50_le * 1e3:g}",
        "decision_p99_ms": f"{p99 * 1e3:.2f}", "decision_p99_le_ms": f"{p99_le * 1e3:g}",
        "decision_mean_ms": f"{_mean(before, after, name) * 1e3:.2f}",
        "reply_p50_ms": f"{load.p50_s * 1e3:.2f}", "reply_p99_ms": f"{load.p99_s * 1e3:.2f}",
        "router_cpu_per_req_ms": f"{load.per_request_cpu_s * 1e3:.3f}",
        "coordinator_cpu_per_req_ms": f"{coordinator_cpu / max(1, load.requests) * 1e3:.3f}",
        "engine_cpu_per_req_ms": f"{engine_cpu / max(1, load.requests) * 1e3:.3f}",
        "generator_cpu_per_req_ms": f"{generator_cpu / max(1, load.requests) * 1e3:.3f}",
        "score_failures": f"{failures:g}", "load_avg": _load_average(),
    }  # fmt: skip
    if clients is None:
        extra["sent_late"] = f"{late}"  # more than 1 ms behind schedule: the generator's lag
    return BenchRow(
        f"route decision (body, score, choice), scores from {mode}, "
        f"{args.prompt_tokens}-token prompts, "
        f"{args.chunks} chunks, {how} ({load.generator})",
        None, None, f"p99 ≤ 5 ms at {args.rate:g} req/s" if clients is None else "",
        extra,
        met=(p99_le <= 5e-3 and late <= 0.01 * load.requests) if clients is None else None,
        shown=f"p99 {p99 * 1e3:.2f} ms (≤ {p99_le * 1e3:g})",
    )  # fmt: skip


STREAM = "kvatlas:bench-router"
ROUTERS = {"kvatlas": "http", "kvatlas-replica": "replica", "round-robin": ""}
"""The routers: a name → where its scores come from (``""``: none, the proxy alone)."""


def _stream_end(redis_url: str) -> str:
    """The id of the stream's last entry."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        entries: Any = client.xrevrange(STREAM, count=1)
        return bytes(entries[0][0]).decode()
    finally:
        client.close()


def _wait(ready: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    from kvatlas.client import RedisStreamTransport
    from kvatlas.soak.fleet import RedisProcess

    if args.quick:
        args.chunks, args.seconds, args.ttft_requests = 4_000, 2.0, 60
    rng = np.random.default_rng(args.seed)
    meta: dict[str, Any] = vars(args).copy()
    meta.pop("json", None)
    meta["load_avg_start"] = _load_average()
    work = build_workload(rng, args.chunks, ENGINES)  # its instances are the engines
    prompts = [build_query(rng, work.docs, args.prompt_tokens).tolist() for _ in range(64)]
    bodies = [json.dumps({"model": MODEL, "prompt": p, "max_tokens": 1}).encode() for p in prompts]
    stream = [json.dumps({"model": MODEL, "prompt": p, "max_tokens": 1, "stream": True}).encode()
              for p in prompts[:8]]  # fmt: skip
    if wrk_path() is None:
        warn_no_wrk()
    procs = []
    rows: list[BenchRow] = []
    tmp = tempfile.TemporaryDirectory(prefix="kvatlas-bench-router-")
    redis_server = RedisProcess(Path(tmp.name), Path(tmp.name) / "redis.log")
    try:
        redis_server.start()  # on its port before the others are chosen: free_port reserves none
        engine_port, coord_port = free_port(), free_port()
        engine, coord = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{coord_port}"
        ports = {name: free_port() for name in ROUTERS}
        with Progress(transient=True) as progress:
            task = progress.add_task("redis, engine, coordinator, routers; load; TTFT", total=8)
            code = f"from kvatlas.bench.router import serve_echo_engine; serve_echo_engine({engine_port})"
            procs.append(spawn_service(["-c", code], engine))
            engine_pid = procs[-1].pid
            # the coordinator's flags for the stream: the stand-alone one's and the router's
            # replica's alike (each with its own replica id)
            on_stream = ["--chunk-size", str(CHUNK), "--enable-blend-lookup",
                         "--event-transport", "redis", "--redis-url", redis_server.url,
                         "--event-stream", STREAM]  # fmt: skip
            flags = ["--port", str(coord_port), *on_stream, "--replica-id", "bench-coordinator",
                     "--max-body-bytes", str(1 << 30), "--log-level", "warning"]  # fmt: skip
            procs.append(
                spawn_service(["-m", "kvatlas.cli", "coordinator", *flags], coord, timeout=300)
            )
            coordinator_pid = procs[-1].pid
            with httpx.Client(base_url=coord, timeout=300) as http:
                for inst in work.instances:
                    http.post("/instances", json={"instance_id": inst}).raise_for_status()
            sink = RedisStreamTransport(redis_server.url, STREAM)
            for start in range(0, len(work.batches), 4):
                sink.send(work.batches[start : start + 4])
            sink.close()
            end = _stream_end(redis_server.url)
            with httpx.Client(timeout=5) as poll:  # one for every poll (processes.is_healthy)
                _wait(lambda: poll.get(f"{coord}/healthz").json()["stream_position"] == end,
                      "the coordinator reading the stream")  # fmt: skip
                engines = [f for i in work.instances for f in ("--engine", f"{i}={engine}")]
                started = []
                for name, port in ports.items():
                    source = ROUTERS[name]
                    rflags = ["--port", str(port), "--coordinator-url", coord, *engines,
                              "--policy", "round-robin" if not source else "kvatlas",
                              "--log-level", "warning", "--max-body-bytes", str(1 << 24),
                              "--score-timeout-s", "1"]  # fmt: skip
                    if source == "replica":  # no --coordinator-url: no HTTP score meanwhile
                        rflags = [*rflags[:2], *rflags[4:], "--scores-from", "replica", *on_stream,
                                  "--replica-id", "bench-router"]  # fmt: skip
                    started.append(
                        (["-m", "kvatlas.cli", "router", *rflags], f"http://127.0.0.1:{port}")
                    )
                procs += spawn_services(started, timeout=300)  # side by side
                pids = {
                    name: proc.pid for name, proc in zip(ports, procs[-len(ports) :], strict=True)
                }
                replica_url = f"http://127.0.0.1:{ports['kvatlas-replica']}/healthz"
                _wait(lambda: poll.get(replica_url).json()["scores"] == "replica serving",
                      "the router's replica reading the stream")  # fmt: skip
            progress.advance(task)
            with httpx.Client(timeout=60) as client:
                routers = {p: f"http://127.0.0.1:{port}" for p, port in ports.items()}
                for url in routers.values():
                    for body in bodies[:16]:  # warm-up
                        client.post(f"{url}/v1/completions", content=body,
                                    headers={"content-type": "application/json"}).raise_for_status()  # fmt: skip
                for name in ("kvatlas", "kvatlas-replica"):
                    k_pids = (pids[name], coordinator_pid, engine_pid)
                    for clients in (None, args.clients, 1):
                        rows.append(_decision_row(args, client, ports[name], ROUTERS[name],
                                                  k_pids, bodies, clients))  # fmt: skip
                        progress.advance(task)
                first_byte: dict[str, list[float]] = {"direct": [], **{p: [] for p in routers}}
                for k in range(args.ttft_requests):  # interleaved: drift hits every column
                    body = stream[k % len(stream)]
                    first_byte["direct"].append(
                        _first_byte_s(client, f"{engine}/v1/completions", body)
                    )
                    for name, url in routers.items():
                        first_byte[name].append(
                            _first_byte_s(client, f"{url}/v1/completions", body)
                        )
                progress.advance(task)
        direct = statistics.median(first_byte["direct"])
        for name, source in ROUTERS.items():
            added = statistics.median(first_byte[name]) - direct
            what = f"score from {source} + proxy" if source else "proxy alone"
            policy = "kvatlas" if source else name
            rows.append(BenchRow(
                f"added time to first byte, --policy {policy} ({what}), stream, "
                f"{args.prompt_tokens}-token prompts (routed − direct, medians, sequential)",
                added, None, "≤ 2 ms" if source else "",
                {"direct_p50_ms": f"{direct * 1e3:.2f}",
                 "routed_p50_ms": f"{statistics.median(first_byte[name]) * 1e3:.2f}",
                 "load_avg": _load_average()},
                met=added <= 2e-3 if source else None,
                shown=f"{added * 1e3:.2f} ms",
            ))  # fmt: skip
    finally:
        stop(procs)
        redis_server.kill()
        tmp.cleanup()
    meta["load_avg_end"] = _load_average()
    report("kvatlas bench router", rows, args, meta)
    return 0
