"""``kvatlas router --scores-from replica`` (issue 26 item 5; docs/router.md, "Scoring: over
HTTP or from a replica in the router"): a coordinator replica in the router's process, fed by
the Redis stream every replica reads, scores each request by a function call.

Real processes on loopback, a real redis-server: a stand-alone coordinator on the Redis
transport, a router scoring over HTTP against it, and a router with its own replica, in front
of two fake vLLM engines; the directory comes through the stream (two nodes' ``EventSink``s
named as the engines). The two routers must decide alike (engine and predicted reuse); a prompt
nobody holds is routed by load with no reuse predicted; a replica that cannot be serving (Redis
away) routes by load and counts it, or scores over HTTP when ``--coordinator-url`` is given;
``--scores-from replica`` without the Redis transport is refused at start (exit 2).
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest
import redis

from kvatlas.asgi_thread import free_port
from kvatlas.cli import main
from kvatlas.client import EventSink, RedisStreamTransport
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.events import CacheEntry
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_services, stop
from kvatlas.router_replica import INLINE_TOKENS
from tests.conftest import HTTP, RedisServer, wait_for
from tests.coordinator.security_support import bearer, token
from tests.helpers import write_tokens
from tests.router.fake_vllm import FakeVllm

if TYPE_CHECKING:
    from kvatlas.coordinator.service import CoordinatorService
    from kvatlas.router.scores import Scorer
    from kvatlas.router_replica import ReplicaScorer

MODEL = "toy"
ENGINES = ("pod-a", "pod-b")
C = 16
RANK = pack_kv_rank(1, 0, 1, 0)
STREAM = "kvatlas:router-replica"
rng = np.random.default_rng(26)
DOC_A, DOC_B, DOC_C = (rng.integers(1000, 30_000, 16 * C).astype(np.uint32) for _ in range(3))


def entries(doc: np.ndarray, offset: int = 0, salt: str = "") -> list[CacheEntry]:
    return [
        CacheEntry(
            ObjectKey(h, MODEL, RANK, 0, salt), 4096, doc[c * C : (c + 1) * C], offset + c * C
        )
        for c, h in enumerate(chunk_hashes(doc, C))
    ]


def feed(redis_url: str) -> str:
    """pod-a holds DOC_A (L1), pod-b DOC_B (L1) and DOC_C (L2, a fragment source); the id of
    the stream's last entry."""
    sinks = {
        e: EventSink(e, RedisStreamTransport(redis_url, STREAM), incarnation=1) for e in ENGINES
    }
    sinks["pod-a"].emit("store", "l1", "dram", entries(DOC_A))
    sinks["pod-b"].emit("store", "l1", "dram", entries(DOC_B))
    sinks["pod-b"].emit("store", "l2", "fs", entries(DOC_C))
    for sink in sinks.values():
        assert sink.flush(60)
        sink.close(timeout=5)
    client = redis.Redis.from_url(redis_url)
    try:
        last = client.xrevrange(STREAM, count=1)[0][0]
    finally:
        client.close()
    return last.decode() if isinstance(last, bytes) else str(last)


def replica_flags(redis_url: str, replica_id: str, stream: str = STREAM) -> list[str]:
    """The coordinator's flags a router's replica takes (the stand-alone one's, its own id)."""
    return ["--event-transport", "redis", "--redis-url", redis_url, "--event-stream", stream,
            "--chunk-size", str(C), "--replica-id", replica_id]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer) -> Iterator[dict[str, Any]]:
    engines = {name: FakeVllm(name, MODEL, max_model_len=1 << 16) for name in ENGINES}
    engine_flags = [f for n, e in engines.items() for f in ("--engine", f"{n}={e.url}")]
    last = feed(redis_server.url)
    coord_port, http_port, replica_port = free_port(), free_port(), free_port()
    coord = f"http://127.0.0.1:{coord_port}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # a loaded machine: no score missed by time; a fresh numba cache compiles in two at once
        common = [*engine_flags, "--health-interval-s", "0.2", "--metrics-interval-s", "0.2",
                  "--score-timeout-s", "10"]  # fmt: skip
        router = ["-m", "kvatlas.cli", "router", "--log-level", "warning", *common]
        coordinator = ["-m", "kvatlas.cli", "coordinator", "--port", str(coord_port),
                       "--log-level", "warning", *replica_flags(redis_server.url, "standalone")]  # fmt: skip
        with_replica = [*router, "--port", str(replica_port), "--scores-from", "replica",
                        *replica_flags(redis_server.url, "router-1")]  # fmt: skip
        services = [
            (coordinator, coord),
            ([*router, "--port", str(http_port), "--coordinator-url", coord],
             f"http://127.0.0.1:{http_port}"),
            (with_replica, f"http://127.0.0.1:{replica_port}"),
        ]  # fmt: skip
        procs += spawn_services(services, timeout=180)
        routers = {"http": f"http://127.0.0.1:{http_port}",
                   "replica": f"http://127.0.0.1:{replica_port}"}  # fmt: skip
        # the replica is serving once it read the stream to its end: it holds the feed
        assert wait_for(lambda: health(routers["replica"])["scores"] == "replica serving", 60)
        assert wait_for(lambda: HTTP.get(f"{coord}/healthz").json()["stream_position"] == last, 60)
        assert health(routers["http"])["scores"] == "http"
        yield {"coordinator": coord, "routers": routers, "engines": engines,
               "engine_flags": engine_flags}  # fmt: skip
    finally:
        stop(procs)
        for engine in engines.values():
            engine.close()


@dataclass
class IdleReplica:
    """A coordinator replica in this process that never started (``restoring``; set it to
    ``serving`` and it scores from its empty directory), with its match pool."""

    service: CoordinatorService
    pool: Executor

    def scorer(self, fallback: Scorer | None = None) -> ReplicaScorer:
        from kvatlas.coordinator.route_score import RouteScoring
        from kvatlas.router_replica import ReplicaScorer

        return ReplicaScorer(self.service, RouteScoring(self.service, self.pool), self.pool,
                             fallback)  # fmt: skip


@pytest.fixture
def idle_replica() -> Iterator[IdleReplica]:
    from kvatlas.coordinator.app import new_query_pool
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.service import CoordinatorService

    config = CoordinatorConfig(chunk_size=C, event_transport="redis",
                               redis_url=f"redis://127.0.0.1:{free_port()}/0")  # fmt: skip
    pool = new_query_pool()
    try:
        yield IdleReplica(CoordinatorService(config), pool)  # not started: nothing of it runs
    finally:
        pool.shutdown()


def health(router: str) -> dict[str, Any]:
    reply: dict[str, Any] = HTTP.get(f"{router}/healthz", timeout=10).json()
    return reply


def metric(router: str, name: str) -> float:
    text = HTTP.get(f"{router}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))  # fmt: skip


def route(router: str, prompt: list[int]) -> tuple[str, float]:
    """The engine ``router`` chose for ``prompt`` and the reuse it predicted there (one request
    at a time: every engine idle first, so load is equal and only the scores differ)."""
    assert wait_for(lambda: all(e["in_flight"] == 0 for e in health(router)["engines"].values()))
    predicted = "kvatlas_router_predicted_reused_tokens_total"
    before = metric(router, predicted)
    reply = httpx.post(f"{router}/v1/completions", json={"model": MODEL, "prompt": prompt,
                       "max_tokens": 1}, timeout=30)  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.headers["x-kvatlas-engine"], metric(router, predicted) - before


def test_the_replica_routes_as_the_coordinator_over_http_does(fleet: dict[str, Any]) -> None:
    routers = fleet["routers"]
    failures = {k: metric(r, "kvatlas_router_score_failures_total") for k, r in routers.items()}
    tail = [7, 8, 9]
    prompts = {
        "pod-a's document": ([*DOC_A.tolist(), *tail], "pod-a", 16 * C),
        "pod-b's document": ([*DOC_B.tolist(), *tail], "pod-b", 16 * C),
        "pod-a's half": ([*DOC_A[: 8 * C].tolist(), *tail], "pod-a", 8 * C),
        # longer than INLINE_TOKENS: scored on the replica's match pool, not the event loop
        "pod-b's document, long": ([*DOC_B.tolist(), *range(INLINE_TOKENS)], "pod-b", 16 * C),
        # pod-b's fragment (L2) at another offset, after a prefix of pod-a's: both routers weigh
        # the same coverage, whichever wins
        "mixed": ([*DOC_A[: 2 * C].tolist(), *DOC_C.tolist(), *tail], None, None),
    }
    for what, (prompt, holder, reused) in prompts.items():
        by_http = route(routers["http"], prompt)
        by_replica = route(routers["replica"], prompt)
        assert by_replica == by_http, what
        if holder is not None:
            assert by_replica == (holder, reused), what
    for kind, router in routers.items():  # every request was scored, none by load
        assert metric(router, "kvatlas_router_score_failures_total") == failures[kind]


REPLICA_SERIES = ("kvatlas_directory_keys", "kvatlas_directory_chunks",
                  "kvatlas_directory_placements", "kvatlas_stream_position_seconds")  # fmt: skip


def test_the_routers_metrics_show_its_replica_by_the_coordinators_names(
    fleet: dict[str, Any],
) -> None:
    """The router's ``/metrics`` exports its replica's health under the coordinator's own
    names (the old router exported none of them): readiness, where it stands in the stream and
    how far behind, its directory's size, stream errors, its scores' latency; the values equal
    the stand-alone coordinator's, which read the same stream. One exposition, every family
    once (the router's ``kvatlas_http_refused_total`` is not doubled by the replica's)."""
    from prometheus_client.parser import text_string_to_metric_families

    router, coordinator = fleet["routers"]["replica"], fleet["coordinator"]
    position = httpx.get(f"{coordinator}/healthz", timeout=10).json()["stream_position"]
    at_s = int(position.split("-")[0]) / 1000
    assert wait_for(lambda: metric(router, "kvatlas_stream_position_seconds") == at_s, 30)
    for name in REPLICA_SERIES:
        assert metric(router, name) == metric(coordinator, name) > 0, name
    assert metric(router, 'kvatlas_readiness{state="serving"}') == 1
    assert metric(router, 'kvatlas_readiness{state="catching_up"}') == 0
    assert metric(router, "kvatlas_stream_lag_entries") == 0
    route(router, [*DOC_A.tolist(), 4])
    assert metric(router, "kvatlas_route_score_seconds_count") >= 1
    text = httpx.get(f"{router}/metrics", timeout=10).text
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
    assert {"kvatlas_stream_errors", "kvatlas_snapshot_failures", "kvatlas_router_decisions",
            "kvatlas_http_refused"} <= set(names)  # fmt: skip


def test_a_prompt_nobody_holds_is_routed_by_load(fleet: dict[str, Any]) -> None:
    """The negative control: the score says nobody holds it (no failure counted), no reuse."""
    router = fleet["routers"]["replica"]
    failures = metric(router, "kvatlas_router_score_failures_total")
    nobody = rng.integers(40_000, 50_000, 8 * C).tolist()
    for _ in range(2):
        engine, predicted = route(router, nobody)
        assert engine in ENGINES and predicted == 0
    assert metric(router, "kvatlas_router_score_failures_total") == failures


def test_a_replica_not_serving_routes_by_load_and_counts_it(
    fleet: dict[str, Any], procs: list[subprocess.Popen[bytes]]
) -> None:
    """Redis away: the router starts, its replica waits for Redis (``waiting_for_redis``) and
    cannot score; each request is routed by load and counted, never held."""
    away = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs += spawn_services([(
        ["-m", "kvatlas.cli", "router", "--log-level", "warning", "--port", str(port),
         *fleet["engine_flags"], "--scores-from", "replica", *replica_flags(away, "router-away")],
        url,
    )])  # fmt: skip
    assert health(url)["scores"] == "replica waiting_for_redis"
    engine, predicted = route(url, [*DOC_B.tolist(), 5])
    assert engine in ENGINES and predicted == 0
    assert metric(url, "kvatlas_router_score_failures_total") == 1


class _OldCoordinator(ThreadingHTTPServer):
    """A coordinator older than the router's msgpack score body (it reads every body as JSON:
    422, as ``tests/client/test_route_score_fallback.py``'s stand-in): pod-b holds 64 tokens."""

    daemon_threads = True

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-type") == "application/msgpack":
                    status, body = 422, b'{"detail":"body: JSON is malformed: invalid character"}'
                else:
                    status, body = 200, (
                        b'{"instances":[{"instance_id":"pod-b","score":64.0,"prefix_tokens":64,'
                        b'"fragment_tokens":0,"by_tier":{"gpu":0,"l1":64,"l2":0,"peer":0}}],'
                        b'"query_tokens":257}'
                    )  # fmt: skip
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_the_routers_metrics_are_the_same_set_whichever_scorer(
    fleet: dict[str, Any], procs: list[subprocess.Popen[bytes]]
) -> None:
    """A router with a replica that is not serving (Redis away) scores over HTTP meanwhile,
    against a coordinator that takes JSON score bodies only: the fallback to JSON is counted
    in ``kvatlas_router_score_json_fallbacks_total`` as by a router scoring over HTTP (the old
    router's replica scored through a client of its own, whose fallbacks nobody counted), and
    the router's ``kvatlas_router_*`` families are those of the router scoring over HTTP."""
    from prometheus_client.parser import text_string_to_metric_families

    old = _OldCoordinator()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    away = f"redis://127.0.0.1:{free_port()}/0"
    try:
        procs += spawn_services([(
            ["-m", "kvatlas.cli", "router", "--log-level", "warning", "--port", str(port),
             *fleet["engine_flags"], "--scores-from", "replica", "--score-timeout-s", "10",
             *replica_flags(away, "router-json"),
             "--coordinator-url", f"http://127.0.0.1:{old.server_address[1]}"],
            url,
        )])  # fmt: skip
        assert health(url)["scores"] == "replica waiting_for_redis, http meanwhile"
        assert route(url, [*DOC_B.tolist(), 6]) == ("pod-b", 64)
        assert metric(url, "kvatlas_router_score_json_fallbacks_total") == 1
        assert metric(url, "kvatlas_router_score_failures_total") == 0

        def router_families(router: str) -> set[str]:
            text = httpx.get(f"{router}/metrics", timeout=10).text
            return {f.name for f in text_string_to_metric_families(text)
                    if f.name.startswith("kvatlas_router_")}  # fmt: skip

        for kind in ("http", "replica"):  # a labelled family shows once a request used it
            route(fleet["routers"][kind], [*DOC_B.tolist(), 6])
            assert router_families(url) == router_families(fleet["routers"][kind]), kind
    finally:
        old.shutdown()
        old.server_close()


def test_the_replica_scores_only_the_salts_the_routers_token_may_see(
    fleet: dict[str, Any],
    redis_server: RedisServer,
    procs: list[subprocess.Popen[bytes]],
    tmp_path: Path,
    idle_replica: IdleReplica,
) -> None:
    """Auth on. Over HTTP the coordinator applies the router's ``--coordinator-token-file`` (a
    ``lookup`` token bound to the salts of the tenants the router serves) to every score; the
    router's replica applies it the same way (the old replica scored as admin): a client whose
    route token may route tenant-b, through a router whose own token is bound to tenant-a, gets
    no score for tenant-b's copies (routed by load, counted, no reuse predicted), and one for
    tenant-a's. A route token bound to tenant-a asking for tenant-b is refused (403) before any
    score, and the replica refuses it too if asked (the client's binding, passed down)."""
    from kvatlas.auth import Principal

    emit, router_token, route_ab, route_a, admin = (
        token(n) for n in ("emit", "router", "route-ab", "route-a", "admin")
    )
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": emit, "roles": ["emit"], "instance_ids": list(ENGINES)},
        {"token": router_token, "roles": ["lookup"], "cache_salts": ["tenant-a"]},
        {"token": route_ab, "roles": ["route"], "cache_salts": ["tenant-a", "tenant-b"]},
        {"token": route_a, "roles": ["route"], "cache_salts": ["tenant-a"]},
        {"token": admin, "roles": ["admin"]},
    )
    router_token_file = tmp_path / "router-token"
    router_token_file.write_text(router_token)
    router_token_file.chmod(0o600)
    stream = "kvatlas:router-replica-auth"
    sinks = {e: EventSink(e, RedisStreamTransport(redis_server.url, stream, token=emit),
                          incarnation=1) for e in ENGINES}  # fmt: skip
    sinks["pod-a"].emit("store", "l1", "dram", entries(DOC_A, salt="tenant-a"))
    sinks["pod-b"].emit("store", "l1", "dram", entries(DOC_B, salt="tenant-b"))
    for sink in sinks.values():
        assert sink.flush(60)
        sink.close(timeout=5)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs += spawn_services([(
        ["-m", "kvatlas.cli", "router", "--log-level", "warning", "--port", str(port),
         *fleet["engine_flags"], "--scores-from", "replica", "--score-timeout-s", "10",
         "--auth-token-file", str(tokens), "--coordinator-token-file", str(router_token_file),
         *replica_flags(redis_server.url, "router-auth", stream)],
        url,
    )])  # fmt: skip
    assert wait_for(lambda: health(url)["scores"] == "replica serving", 60)

    def count(name: str) -> float:
        text = HTTP.get(f"{url}/metrics", headers=bearer(admin), timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))  # fmt: skip

    def routed(who: str, doc: np.ndarray, salt: str) -> tuple[int, str | None, float]:
        assert wait_for(lambda: all(e["in_flight"] == 0 for e in health(url)["engines"].values()))
        before = count("kvatlas_router_predicted_reused_tokens_total")
        reply = httpx.post(f"{url}/v1/completions", headers=bearer(who), timeout=30, json={
            "model": MODEL, "prompt": [*doc.tolist(), 3], "max_tokens": 1, "cache_salt": salt,
        })  # fmt: skip
        reused = count("kvatlas_router_predicted_reused_tokens_total") - before
        return reply.status_code, reply.headers.get("x-kvatlas-engine"), reused

    failures = count("kvatlas_router_score_failures_total")
    assert routed(route_ab, DOC_A, "tenant-a") == (200, "pod-a", 16 * C)  # the router's salt
    assert count("kvatlas_router_score_failures_total") == failures
    status, engine, reused = routed(route_ab, DOC_B, "tenant-b")  # not the router's salt
    assert (status, reused) == (200, 0) and engine in ENGINES
    assert count("kvatlas_router_score_failures_total") == failures + 1
    assert routed(route_a, DOC_B, "tenant-b")[0] == 403  # the client's own binding
    assert count("kvatlas_router_score_failures_total") == failures + 1  # refused before

    # the replica applies the client's binding too, when asked directly (defence in depth)
    from kvatlas.coordinator.views import Readiness

    idle_replica.service.readiness.set(Readiness.SERVING)
    client_a = Principal("route-a", frozenset({"route"}), cache_salts=frozenset({"tenant-a"}))
    prompt = np.asarray([*DOC_B.tolist(), 5], dtype=np.uint32)

    async def ask(salt: str) -> int:
        try:
            await idle_replica.scorer().score(prompt, MODEL, salt, ENGINES, 10.0, who=client_a)
        except CoordinatorError as exc:
            return exc.reply_status or 0
        return 200

    assert asyncio.run(ask("tenant-a")) == 200
    assert asyncio.run(ask("tenant-b")) == 403


def test_a_replica_not_serving_scores_over_http_meanwhile(
    fleet: dict[str, Any], idle_replica: IdleReplica
) -> None:
    """With ``--coordinator-url`` too, the coordinator's HTTP score stands in while the replica
    is not serving (in process: a replica never started is ``restoring``), and from the
    replica once it serves."""
    from kvatlas.client.route_client import AsyncRouteClient
    from kvatlas.coordinator.views import Readiness
    from kvatlas.router.scores import HttpScorer

    service = idle_replica.service

    async def scores() -> tuple[list[tuple[str, int]], list[tuple[str, int]], str, str]:
        scorer = idle_replica.scorer(HttpScorer(AsyncRouteClient(fleet["coordinator"]), owned=True))
        try:
            prompt = np.asarray([*DOC_B.tolist(), 5], dtype=np.uint32)
            meanwhile = await scorer.score(prompt, MODEL, "", ENGINES, 10.0)
            status = scorer.status()
            service.readiness.set(Readiness.SERVING)  # its (empty) directory answers now
            own = await scorer.score(prompt, MODEL, "", ENGINES, 10.0)
            rows = [
                [(r.instance_id, r.prefix_tokens) for r in s.instances] for s in (meanwhile, own)
            ]
            return rows[0], rows[1], status, scorer.status()
        finally:
            await scorer.aclose()

    meanwhile, own, before, after = asyncio.run(scores())
    assert before == "replica restoring, http meanwhile" and after == "replica serving"
    assert meanwhile[0] == ("pod-b", 16 * C)  # the stand-alone coordinator's directory
    assert sorted(own) == [("pod-a", 0), ("pod-b", 0)]  # the replica's own, empty


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ([], "--scores-from replica needs --event-transport redis"),
        (["--event-transport", "redis"], "--redis-url"),
    ],
)
def test_replica_without_the_redis_transport_is_refused_at_start(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by ``kvatlas router``'s own parsing (the process's entry point, called here):
    exit 2 and a message naming the flags, before anything starts."""
    argv = ["router", "--scores-from", "replica", "--engine", "pod-a=http://127.0.0.1:9", *flags]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_score_never_waits_on_the_loop_for_the_directorys_lock(
    idle_replica: IdleReplica,
) -> None:
    """A change holding the directory (a stream batch applied, a fence) while a short prompt
    is scored: the score goes to the match pool and the router's event loop keeps running
    (the old code scored on the loop, which then waited for the lock with every request it
    proxies). No clock: the order of events is what is checked; the lock is let go after 10 s
    at the latest so that the old code finishes (and fails) instead of hanging."""
    from kvatlas.coordinator.views import Readiness

    service = idle_replica.service
    service.readiness.set(Readiness.SERVING)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with service.directory._lock:  # what ingest and fencing hold while they change it
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    order: list[str] = []

    async def run() -> None:
        scorer = idle_replica.scorer()
        prompt = np.asarray([*DOC_B.tolist(), 5], dtype=np.uint32)

        async def score() -> None:
            await scorer.score(prompt, MODEL, "", ENGINES, 30.0)
            order.append("scored")

        task = asyncio.create_task(score())
        await asyncio.sleep(0)  # the score starts
        order.append("loop ran")
        release.set()
        await task

    try:
        asyncio.run(run())
    finally:
        release.set()
        holder.join()
    assert order == ["loop ran", "scored"]


def test_the_routers_replica_takes_no_cache_control_leases() -> None:
    """A router's replica knows no registrations: it could deliver no command, so it runs no
    delivery loop (whose passes claim leases on every unfinished command: the old code held
    each for a failed attempt and its backoff, delaying the replica that can deliver)."""
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.service import CoordinatorService

    config = CoordinatorConfig(chunk_size=C, event_transport="http")
    for delivers, expected in ((False, False), (True, True)):  # the second: the control
        service = CoordinatorService(config, delivers=delivers)
        service.start()
        try:
            names = {t.name for t in threading.enumerate()}
            assert ("kvatlas-cache-control" in names) is expected
        finally:
            service.stop()


def test_a_routers_token_its_replica_does_not_know_is_refused_at_start(tmp_path: Path) -> None:
    """The replica scores as the router's ``--coordinator-token-file`` token: one the token
    file (``--auth-token-file``) does not hold is refused, naming the flag, before anything
    starts (a coordinator would answer 401 to every score), and so is a token without a token
    file; the negative controls: a known token is its principal, and without auth and token
    the replica scores as anyone."""
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.router.config import RouterConfig
    from kvatlas.router_replica import scoring_principal

    known = token("router")
    tokens = write_tokens(tmp_path / "tokens.json",
                          {"token": known, "roles": ["lookup"], "cache_salts": ["tenant-a"]})  # fmt: skip
    replica = CoordinatorConfig(chunk_size=C, auth_token_file=tokens)
    for name, value in (("unknown", token("stranger")), ("known", known)):
        path = tmp_path / name
        path.write_text(value)
        path.chmod(0o600)

    def router(name: str) -> RouterConfig:
        return RouterConfig(engine="a=http://127.0.0.1:9", scores_from="replica",
                            coordinator_token_file=tmp_path / name)  # fmt: skip

    with pytest.raises(ValueError, match="--coordinator-token-file"):
        scoring_principal(router("unknown"), replica)
    assert scoring_principal(router("known"), replica).cache_salts == frozenset({"tenant-a"})
    # a router token but no token file to know its binding: refused, not scored as admin
    # (over HTTP a coordinator with auth would bind it to its salts)
    with pytest.raises(ValueError, match="needs --auth-token-file"):
        scoring_principal(router("known"), CoordinatorConfig(chunk_size=C))
    nobody = RouterConfig(engine="a=http://127.0.0.1:9", scores_from="replica")
    assert scoring_principal(nobody, CoordinatorConfig(chunk_size=C)).is_admin


def test_a_second_router_replica_with_the_same_snapshot_exits_1(tmp_path: Path) -> None:
    """The router's replica claims its snapshot lock as ``kvatlas coordinator`` does (one
    ``claim_or_exit``): while another process holds it, ``kvatlas router --scores-from replica``
    logs why and exits 1 before it restores, joins the group or serves."""
    import sys

    from kvatlas.coordinator.server import lock_snapshot_path

    snapshot = tmp_path / "router.snap"
    held = lock_snapshot_path(snapshot)  # the live twin
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvatlas.cli", "router", "--port", str(free_port()),
             "--engine", "pod-a=http://127.0.0.1:9", "--scores-from", "replica",
             "--snapshot-path", str(snapshot),
             *replica_flags(f"redis://127.0.0.1:{free_port()}/0", "router-twin")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        held.close()
    assert done.returncode == 1, done.stderr
    assert "is another replica with this id running? not starting" in done.stderr
    assert not snapshot.exists()


def test_a_redis_that_appears_refusing_the_credentials_stops_the_router(tmp_path: Path) -> None:
    """The router's replica meets what a coordinator started before Redis meets: Redis comes
    up and refuses its credentials. It retried for ever (routing by load, its replica
    ``waiting_for_redis``); it stops, exit 1, naming the refusal, as ``kvatlas coordinator``."""
    import sys

    server = RedisServer(tmp_path)  # not started yet
    # a user this Redis does not have (without requirepass any password is the default user's)
    wrong = f"redis://kvatlas-router:s3cret@127.0.0.1:{server.port}/0"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvatlas.cli", "router", "--port", str(port),
         "--engine", "pod-a=http://127.0.0.1:9", "--scores-from", "replica",
         *replica_flags(wrong, "router-refused")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), timeout=120)
        server.start()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert "refused this coordinator's credentials" in err, err
    finally:
        proc.kill()
        server.stop()


def _answers(url: str) -> bool:
    try:
        return HTTP.get(url, timeout=5).status_code in (200, 503)
    except httpx.HTTPError:
        return False
