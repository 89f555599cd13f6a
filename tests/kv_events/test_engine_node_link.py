"""An engine that reuses KV through its own kvatlas node (the kvatlas connector): ``kvatlas
node --engine-id pod-a`` makes ``POST /route/score`` count the node's copies as ``pod-a``'s.

Real processes on loopback: a coordinator subscribed to two fake vLLM engines (pyzmq PUB:
``pod-a`` holds an unrelated text in GPU memory, ``pod-b`` the query's first chunk) and two
``kvatlas node`` processes: ``node-a`` (``--engine-id pod-a``) holds the whole query in L1 and
``pod-a`` ranks first, ``node-a`` no candidate of its own; ``node-b``, pod-b's node but started
without the flag (the negative control), holds a second query, and ``pod-b`` gets nothing
from it (no node linked: a plain engine, which reuses no fragment). The link survives a coordinator restart (snapshot) and works with the Redis
transport. The nodes register before either engine published anything: any start order."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvatlas.client import RouteClient
from kvatlas.coordinator.server import free_port
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, RedisServer, wait_for
from tests.coordinator.security_support import spawn_coordinator
from tests.coordinator.test_route_score_fleet import NODE_FLAGS, ranking
from tests.helpers import TOY_LAYOUT
from tests.kv_events.helpers import FakeEngine
from tests.kv_events.test_engine_fleet_ranking import engine_batches, engine_stored

C = 16  # the fleet's chunk size; the engines' vLLM block size is 8
RNG = np.random.default_rng(26)
QUERY = RNG.integers(0, 500, 4 * C).astype(np.uint32)  # node-a's
QUERY_B = RNG.integers(1000, 1500, 4 * C).astype(np.uint32)  # node-b's
OTHER = RNG.integers(500, 900, 2 * C).astype(np.uint32)
PEER_4 = round(0.85 * 0.6 * 4 * C, 3)  # four chunks fetched from another node's L1
LINKED = [
    ("pod-a", 4 * C, 0, round(0.8 * 4 * C, 3)),  # node-a's L1, its own
    ("node-b", 0, 4 * C, PEER_4),
    # its GPU prefix only: no node is linked to pod-b, so it is a plain vLLM engine to the
    # directory (it reuses a prefix of its own blocks, no fragment, no peer's L1)
    ("pod-b", C, 0, round(1.0 * C, 3)),
]
UNLINKED = [  # node-b's query: without the flag, node-b's copies are nothing to pod-b
    ("node-b", 4 * C, 0, round(0.8 * 4 * C, 3)),
    ("pod-a", 0, 4 * C, PEER_4),  # through node-a, which may fetch node-b's L1
    ("pod-b", 0, 0, 0.0),
]


@contextmanager
def linked_fleet(tmp_path: Path, *extra: str) -> Iterator[dict[str, Any]]:
    """Coordinator (snapshot on) + node-a (``--engine-id pod-a``) holding ``QUERY`` + node-b
    (no flag) holding ``QUERY_B`` + engines pod-a and pod-b publishing; ``extra`` goes to the
    coordinator and the nodes (the event transport)."""
    engines = {"pod-a": FakeEngine(), "pod-b": FakeEngine()}
    port = free_port()
    coord = f"http://127.0.0.1:{port}"
    flags = ["--chunk-size", str(C), "--enable-blend-lookup", "--instance-timeout", "600",
             "--snapshot-path", str(tmp_path / "d.snap"),
             "--kv-events-subscribe", ",".join(e.endpoint for e in engines.values()),
             "--kv-events-replay", ",".join(e.replay_endpoint for e in engines.values()),
             *extra]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    layout = TOY_LAYOUT
    clients: list[NodeEngineClient] = []
    fleet: dict[str, Any] = {"coordinator": coord, "port": port, "flags": flags, "procs": procs}
    nodes = {"node-a": ("pod-a", QUERY, free_port()), "node-b": (None, QUERY_B, free_port())}
    try:
        with ThreadPoolExecutor(3) as pool:  # any start order: all three at once
            started = [pool.submit(spawn_coordinator, port, *flags)]
            for name, (serves, _, node_port) in nodes.items():
                args = ["-m", "kvatlas.cli", "node", "--port", str(node_port)]
                args += ["--instance-id", name, *NODE_FLAGS, coord]
                args += ["--coordinator-event-reporting", *extra]
                args += ["--engine-id", serves] if serves else []
                started.append(pool.submit(spawn_service, args, f"http://127.0.0.1:{node_port}"))
            failed = [f.exception() for f in started]  # every started one is stopped
            procs += [f.result() for f in started if f.exception() is None]
            for exc in failed:
                if exc is not None:
                    raise exc
        model = ToyRopeModel(layout)
        for name, (_, tokens, node_port) in nodes.items():
            clients.append(NodeEngineClient(f"http://127.0.0.1:{node_port}", layout))
            assert wait_for(lambda name=name: name in registered(coord), timeout=30)
            assert clients[-1].store(tokens, model.kv_chunks(tokens), request_id=name) == 4
        for n, (name, engine) in enumerate(engines.items()):
            text = (OTHER if name == "pod-a" else QUERY[:C]).tolist()
            engine.send_until(0, engine_stored(text), lambda n=n: engine_batches(coord) == n + 1,
                              topic=f"kv@{name}@toy")  # fmt: skip
        yield fleet
    finally:
        for client in clients:
            client.close()
        stop(procs)
        for engine in engines.values():
            engine.close()


def registered(coord: str) -> dict[str, Any]:
    rows = HTTP.get(f"{coord}/instances").json()["instances"]
    return {r["instance_id"]: r.get("engine_id") for r in rows if r.get("registered", True)}


def settles(
    coord: str, query: np.ndarray, want: list[Any], instances: list[str] | None = None
) -> list[Any]:
    """The ranking of ``query`` (default candidates, or ``instances``) once it equals
    ``want`` (events travel asynchronously), else the last one seen."""
    seen: list[Any] = [None]
    with RouteClient(coord) as router:
        wait_for(
            lambda: (
                seen.append(ranking(router.score(query, "toy", instances=instances)))
                or seen[-1] == want
            ),
            timeout=30,
        )
    return seen[-1]


def test_the_engine_ranks_first_through_its_node_and_after_a_restart(tmp_path: Path) -> None:
    with linked_fleet(tmp_path) as fleet:
        coord = fleet["coordinator"]
        assert settles(coord, QUERY, LINKED) == LINKED
        assert settles(coord, QUERY_B, UNLINKED) == UNLINKED  # negative control
        assert registered(coord) == {"node-a": "pod-a", "node-b": None}
        counts = httpx.get(f"{coord}/healthz").json()["kv_events"]["subscriber"]
        assert counts.get("rejected_foreign", 0) == counts.get("errors", 0) == 0
        # restart the coordinator: the snapshot brings node-a's registration back (the node
        # is still known, so it does not register again: the link is the snapshot's)
        stop([fleet["procs"][0]])
        fleet["procs"][0] = spawn_coordinator(fleet["port"], *fleet["flags"])
        assert registered(coord) == {"node-a": "pod-a", "node-b": None}
        # pod-b, learned from KV events, is a default candidate before it publishes again:
        # the snapshot keeps the engines the coordinator knew
        assert settles(coord, QUERY, LINKED) == LINKED


def test_the_link_holds_with_the_redis_transport(tmp_path: Path, redis_server: RedisServer) -> None:
    stream = "kvatlas:test:engine-node-link"
    redis = [
        "--event-transport",
        "redis",
        "--redis-url",
        redis_server.url,
        "--event-stream",
        stream,
    ]
    with linked_fleet(tmp_path, *redis) as fleet:
        assert settles(fleet["coordinator"], QUERY, LINKED) == LINKED
        assert settles(fleet["coordinator"], QUERY_B, UNLINKED) == UNLINKED
