"""UnifiedBlendLookup over real HTTP: the union when both legs are up, exactly the local-only
result whenever the fleet leg is down, slow, erroring or disabled; deferral, prefix cut,
placement-aware resolution, bounded memory, concurrency."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import numpy as np
import pytest

from kvatlas.client import BlendCoordinatorClient
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.directory import BlendIndex
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.node.segments import FetchCost, Segment
from kvatlas.node.unified_lookup import LookupResult, UnifiedBlendLookup
from tests.conftest import wait_for

CHUNK = 16
NS = BlendNamespace("m")

DOC_FLEET = list(range(1000, 1000 + 2 * CHUNK))  # only the coordinator knows these chunks
DOC_LOCAL = list(range(5000, 5000 + 2 * CHUNK))  # only this node's index knows these
DOC_SHARED = list(range(8000, 8000 + CHUNK))  # both know it
QUERY = [7, 7, 7, *DOC_FLEET, 9, 9, 9, 9, 9, *DOC_LOCAL, *DOC_SHARED, 1, 1]
# positions in QUERY: fleet chunks at 3 and 19, local chunks at 40 and 56, shared chunk at 72
H_FLEET = chunk_hashes(DOC_FLEET, CHUNK)
H_LOCAL = chunk_hashes(DOC_LOCAL, CHUNK)
H_SHARED = chunk_hashes(DOC_SHARED, CHUNK)[0]


def doc_entries(doc: list[int], hashes: list[bytes]) -> tuple[CacheEntry, ...]:
    return tuple(
        CacheEntry(
            ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0)),
            size_bytes=1,
            token_ids=np.asarray(doc[i * CHUNK : (i + 1) * CHUNK]),
            token_offset=i * CHUNK,
        )
        for i, h in enumerate(hashes)
    )


def start_coordinator(enable_blend: bool) -> BackgroundServer:
    config = CoordinatorConfig(port=free_port(), chunk_size=CHUNK, enable_blend_lookup=enable_blend)
    server = BackgroundServer(config).start()
    entries = doc_entries(DOC_FLEET, H_FLEET) + doc_entries(DOC_SHARED, [H_SHARED])
    server.service.ingest([EventBatch("a", 1, 1, "store", "l1", "dram", entries=entries)])
    return server


@pytest.fixture(scope="module")
def coordinator() -> Iterator[BackgroundServer]:
    server = start_coordinator(enable_blend=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def blend_off_coordinator() -> Iterator[BackgroundServer]:
    server = start_coordinator(enable_blend=False)
    yield server
    server.stop()


@pytest.fixture
def local_index() -> BlendIndex:
    index = BlendIndex(CHUNK)
    for i, h in enumerate(H_LOCAL):
        index.add(DOC_LOCAL[i * CHUNK : (i + 1) * CHUNK], h, i * CHUNK, NS)
    index.add(DOC_SHARED, H_SHARED, 0, NS)
    return index


class FakeCoordinator(BaseHTTPRequestHandler):
    """A coordinator that misbehaves on purpose. ``gate``: the reply waits until it is set
    (a slow coordinator the test releases, instead of a timed sleep)."""

    mode: ClassVar[str] = "ok"
    matches: ClassVar[list[dict[str, Any]]] = []
    gate: ClassVar[threading.Event]
    requests: ClassVar[list[str]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        cls = type(self)
        cls.requests.append(json.loads(body)["tokens_b64"])
        cls.gate.wait(timeout=20)
        status, reply = {
            "ok": (200, json.dumps({"matches": cls.matches}).encode()),
            "error": (500, b"boom"),
            "garbage": (200, b"\x00not json"),
        }[cls.mode]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client may have given up already
            self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake() -> Iterator[tuple[str, type[FakeCoordinator]]]:
    class Handler(FakeCoordinator):
        gate = threading.Event()
        requests: ClassVar[list[str]] = []
        matches: ClassVar[list[dict[str, Any]]] = []

    handler = Handler
    handler.gate.set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    handler.gate.set()
    server.shutdown()
    server.server_close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def finish(
    lookup: UnifiedBlendLookup, request_id: str, prefix_len: int = 0, budget: float = 30.0
) -> LookupResult:
    """Poll like an engine would, until the final result (bounded by ``budget``)."""
    deadline = time.monotonic() + budget
    while True:
        result = lookup.poll(request_id, prefix_len)
        if result is not None:
            return result
        assert time.monotonic() < deadline, "lookup stayed pending past its budget"
        time.sleep(0.005)


def run(lookup: UnifiedBlendLookup, prefix_len: int = 0, query: list[int] = QUERY) -> LookupResult:
    lookup.start("req", query, NS)
    return finish(lookup, "req", prefix_len)


def local_only(index: BlendIndex, prefix_len: int = 0, **kwargs: Any) -> LookupResult:
    return run(UnifiedBlendLookup(index, None, chunk_size=CHUNK, **kwargs), prefix_len)


def spans(result: LookupResult) -> list[tuple[bytes, int, int, str]]:
    return [(s.chunk_hash, s.cur_st, s.old_st, s.source) for s in result.segments]


# ---------------------------------------------------------------- both legs up: the union


def test_union_of_both_legs(coordinator: BackgroundServer, local_index: BlendIndex) -> None:
    with BlendCoordinatorClient(coordinator.url) as client:
        result = run(UnifiedBlendLookup(local_index, client, chunk_size=CHUNK))
    assert spans(result) == [
        (H_FLEET[0], 3, 0, "fleet"),
        (H_FLEET[1], 19, CHUNK, "fleet"),
        (H_LOCAL[0], 40, 0, "local"),
        (H_LOCAL[1], 56, CHUNK, "local"),
        (H_SHARED, 72, 0, "both"),
    ]
    assert all(s.length == CHUNK and s.trim == 0 for s in result.segments)
    assert (result.local_matches, result.fleet_matches, result.fleet_only) == (3, 3, 2)
    assert result.fleet_used and not result.fleet_timed_out
    assert result.covered_tokens == 5 * CHUNK


def test_local_only_without_fleet_client(local_index: BlendIndex) -> None:
    result = local_only(local_index)
    assert spans(result) == [
        (H_LOCAL[0], 40, 0, "local"),
        (H_LOCAL[1], 56, CHUNK, "local"),
        (H_SHARED, 72, 0, "local"),
    ]
    assert not result.fleet_used and not result.fleet_timed_out and result.fleet_matches == 0


def test_prefix_filter(coordinator: BackgroundServer, local_index: BlendIndex) -> None:
    """Prefix 25 covers the first fleet chunk and cuts the second (at 19..35) in two."""
    with BlendCoordinatorClient(coordinator.url) as client:
        kept = run(UnifiedBlendLookup(local_index, client, chunk_size=CHUNK), prefix_len=25)
        trimmed = run(
            UnifiedBlendLookup(local_index, client, chunk_size=CHUNK, allow_trim=True),
            prefix_len=25,
        )
    assert [s.cur_st for s in kept.segments] == [40, 56, 72]
    first = trimmed.segments[0]
    assert (first.chunk_hash, first.cur_st, first.length, first.trim) == (H_FLEET[1], 25, 10, 6)
    assert (first.kv_slice, first.delta) == (slice(6, CHUNK), 19 - CHUNK)
    assert trimmed.segments[1:] == kept.segments
    assert all(s.cur_st >= 25 for s in kept.segments + trimmed.segments)


# ---------------------------------------------------------------- degradation


def _fleet_url(
    mode: str, request: pytest.FixtureRequest, fake: tuple[str, type[FakeCoordinator]]
) -> str:
    url, handler = fake
    if mode == "down":
        return f"http://127.0.0.1:{free_port()}"
    if mode == "blend-off":
        server: BackgroundServer = request.getfixturevalue("blend_off_coordinator")
        return server.url
    if mode == "slow":
        handler.gate.clear()  # never answers within the lookup deadline
    else:
        handler.mode = mode
    return url


@pytest.mark.parametrize("mode", ["down", "slow", "error", "garbage", "blend-off"])
@pytest.mark.parametrize("prefix_len", [0, 45])
def test_degrades_to_exactly_local_only(
    mode: str,
    prefix_len: int,
    local_index: BlendIndex,
    request: pytest.FixtureRequest,
    fake: tuple[str, type[FakeCoordinator]],
) -> None:
    url = _fleet_url(mode, request, fake)
    expected = local_only(local_index, prefix_len)
    assert expected.segments  # the comparison below is not vacuous
    # Only the slow leg may hit the deadline: it never answers (gate held), while the others
    # get a deadline far beyond any scheduling delay, so "timed out" means "was slow".
    deadline_s = 0.3 if mode == "slow" else 30.0
    with BlendCoordinatorClient(url, request_timeout=60.0) as client:
        lookup = UnifiedBlendLookup(local_index, client, chunk_size=CHUNK, deadline_s=deadline_s)
        started = time.monotonic()
        result = run(lookup, prefix_len)
        elapsed = time.monotonic() - started
    assert result.segments == expected.segments
    assert result.fleet_matches == 0
    assert result.fleet_timed_out == (mode == "slow")
    assert result.fleet_used == (mode != "slow")
    if mode == "slow":  # the lookup deadline governs, never the (much longer) client timeout
        assert elapsed < 20.0


def test_closed_fleet_client_degrades(local_index: BlendIndex) -> None:
    client = BlendCoordinatorClient(f"http://127.0.0.1:{free_port()}")
    client.close()  # submitting now raises inside the client: must not reach the caller
    result = run(UnifiedBlendLookup(local_index, client, chunk_size=CHUNK))
    assert result.segments == local_only(local_index).segments
    assert not result.fleet_used


def test_implausible_fleet_match_is_rejected(
    local_index: BlendIndex, fake: tuple[str, type[FakeCoordinator]]
) -> None:
    """A reply that places a whole chunk past the end of the request cannot be genuine."""
    url, handler = fake
    handler.matches = [{"chunk_hash": "ab" * 32, "old_st": 0, "cur_st": len(QUERY) - 5}]
    with BlendCoordinatorClient(url) as client:
        lookup = UnifiedBlendLookup(local_index, client, chunk_size=CHUNK)
        result = run(lookup)
    assert result.segments == local_only(local_index).segments
    assert result.fleet_used and result.fleet_matches == 0 and lookup.fleet_rejected == 1


# ---------------------------------------------------------------- deferral and the deadline


def test_defers_while_pending_then_gives_up_at_the_deadline(
    local_index: BlendIndex, fake: tuple[str, type[FakeCoordinator]]
) -> None:
    url, handler = fake
    handler.gate.clear()
    clock = FakeClock()
    with BlendCoordinatorClient(url, request_timeout=10.0) as client:
        lookup = UnifiedBlendLookup(
            local_index, client, chunk_size=CHUNK, deadline_s=1.0, clock=clock
        )
        lookup.start("r", QUERY, NS)
        assert wait_for(lambda: len(handler.requests) == 1)  # the query is in flight
        for now in (0.0, 0.5, 0.999):
            clock.now = now
            assert lookup.poll("r", 0) is None
        clock.now = 1.0
        result = lookup.poll("r", 0)
        assert result is not None
        assert result.fleet_timed_out and not result.fleet_used
        assert result.segments == local_only(local_index).segments
        assert lookup.pending_count() == 0 and lookup.fleet_timeouts == 1
        # the abandoned fleet request is drained from the client once its answer arrives
        assert lookup.orphan_count() == 1
        handler.gate.set()
        assert wait_for(lambda: lookup.orphan_count() == 0)
        assert client.pending_count() == 0


def test_defers_then_merges_a_late_but_in_time_answer(
    local_index: BlendIndex, fake: tuple[str, type[FakeCoordinator]]
) -> None:
    url, handler = fake
    handler.gate.clear()
    handler.matches = [{"chunk_hash": H_FLEET[0].hex(), "old_st": 0, "cur_st": 3}]
    clock = FakeClock()  # frozen: the deadline never passes in this test
    with BlendCoordinatorClient(url, request_timeout=10.0) as client:
        lookup = UnifiedBlendLookup(local_index, client, chunk_size=CHUNK, clock=clock)
        lookup.start("r", QUERY, NS)
        assert lookup.poll("r", 0) is None
        assert lookup.poll("r", 0) is None
        handler.gate.set()
        result = finish(lookup, "r")
    assert result.fleet_used and not result.fleet_timed_out
    assert spans(result)[0] == (H_FLEET[0], 3, 0, "fleet")
    assert result.segments[1:] == local_only(local_index).segments


def test_reused_request_id_never_sees_a_stale_answer(
    local_index: BlendIndex, fake: tuple[str, type[FakeCoordinator]]
) -> None:
    """The first lookup times out with its fleet query still in flight; a new lookup under
    the same request id must send its own query, not inherit the old one's answer."""
    url, handler = fake
    handler.gate.clear()
    clock = FakeClock()
    with BlendCoordinatorClient(url, request_timeout=10.0) as client:
        lookup = UnifiedBlendLookup(local_index, client, chunk_size=CHUNK, clock=clock)
        lookup.start("r", [1] * 40, NS)
        clock.now = 5.0
        assert finish(lookup, "r").fleet_timed_out
        lookup.start("r", QUERY, NS)
        assert wait_for(lambda: len(handler.requests) == 2)
        assert handler.requests[0] != handler.requests[1]
        handler.gate.set()
        assert finish(lookup, "r").fleet_used


# ---------------------------------------------------------------- placement-aware resolution


def test_cost_of_and_prefer_cheaper(
    local_index: BlendIndex, fake: tuple[str, type[FakeCoordinator]]
) -> None:
    """A fleet chunk at 37 overlaps the local chunk at 40: leftmost-greedy keeps the fleet
    one (earlier start), placement-aware resolution the local one (cheaper)."""
    url, handler = fake
    handler.matches = [{"chunk_hash": "cd" * 32, "old_st": 0, "cur_st": 37}]

    def cost_of(s: Segment) -> int:
        return FetchCost.SHARED_L2 if s.source == "fleet" else FetchCost.LOCAL_L1

    with BlendCoordinatorClient(url) as client:
        plain = run(UnifiedBlendLookup(local_index, client, chunk_size=CHUNK, cost_of=cost_of))
        cheaper = run(
            UnifiedBlendLookup(
                local_index, client, chunk_size=CHUNK, cost_of=cost_of, prefer_cheaper=True
            )
        )
    assert [(s.cur_st, s.cost) for s in plain.segments] == [
        (37, FetchCost.SHARED_L2),
        (56, FetchCost.LOCAL_L1),
        (72, FetchCost.LOCAL_L1),
    ]
    assert [(s.cur_st, s.cost) for s in cheaper.segments] == [
        (40, FetchCost.LOCAL_L1),
        (56, FetchCost.LOCAL_L1),
        (72, FetchCost.LOCAL_L1),
    ]


# ---------------------------------------------------------------- lifecycle and memory


def test_final_result_is_forgotten_and_cancel_works(local_index: BlendIndex) -> None:
    lookup = UnifiedBlendLookup(local_index, None, chunk_size=CHUNK)
    run(lookup)
    assert lookup.pending_count() == 0
    with pytest.raises(KeyError):
        lookup.poll("req", 0)
    lookup.start("a", QUERY, NS)
    lookup.start("a", [1, 2, 3], NS)  # once per lookup: the second start is a no-op
    assert lookup.pending_count() == 1
    assert lookup.cancel("a") and not lookup.cancel("a")
    with pytest.raises(KeyError):
        lookup.poll("a", 0)
    with pytest.raises(ValueError):
        lookup.start("b", [-1], NS)
    lookup.start("c", QUERY, NS)
    with pytest.raises(ValueError):
        lookup.poll("c", -1)
    assert lookup.poll("c", 0) is not None
    with pytest.raises(ValueError):
        UnifiedBlendLookup(local_index, None, chunk_size=CHUNK * 2)


def test_abandoned_lookups_expire_and_are_bounded(
    coordinator: BackgroundServer, local_index: BlendIndex
) -> None:
    clock = FakeClock()
    with BlendCoordinatorClient(coordinator.url) as client:
        lookup = UnifiedBlendLookup(
            local_index, client, chunk_size=CHUNK, clock=clock, result_ttl=10.0, max_pending=5
        )
        for i in range(20):
            lookup.start(f"aborted-{i}", QUERY, NS)
        assert lookup.pending_count() == 5 and lookup.evicted == 15
        clock.now = 11.0
        assert lookup.pending_count() == 0 and lookup.expired == 5
        assert wait_for(lambda: lookup.orphan_count() == 0)
        assert client.pending_count() == 0  # nothing left behind in the fleet client either


def test_concurrent_lookups(coordinator: BackgroundServer, local_index: BlendIndex) -> None:
    errors: list[BaseException] = []
    results: list[LookupResult] = []
    with BlendCoordinatorClient(coordinator.url) as client:
        lookup = UnifiedBlendLookup(local_index, client, chunk_size=CHUNK, deadline_s=5.0)
        expected = run(lookup)

        def worker(t: int) -> None:
            try:
                for i in range(15):
                    rid = f"t{t}-{i}"
                    lookup.start(rid, QUERY, NS)
                    results.append(finish(lookup, rid, budget=10.0))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors
        assert len(results) == 8 * 15
        assert all(r.segments == expected.segments for r in results)
        assert lookup.pending_count() == 0 and client.pending_count() == 0
