"""Issue 25 item 14, over real sockets on loopback: a fetch tries every holder of a chunk in
the cheaper tier before falling to a slower one (a ghost placement listed first must not cost
the real peer's L1 copy), and a peer whose fetch failed for want of a connection is down for a
while (``kvatlas/node/peer_health.py``): a dripping peer costs one deadline, is skipped until
its down-time passes, then is tried again. Time is a fake clock for the down-times; the
deadline is real, and shown by counters and accepted connections, never by wall clock."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import FsL2
from kvatlas.node.peer import PeerClient, PeerServer, create_peer_app, max_chunk_bytes
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.tiered_fetch import TieredFetch

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, dtype="float32")
RANK = pack_kv_rank(1, 0, 1, 0)
DEADLINE = 0.3
SERVED = 10.0
"""A deadline a live in-process peer always answers within, even on a loaded 2-core machine
(its thread shares the GIL with the test: 0.3 s was missed there once), for tests whose
subject is where a chunk comes from, not how long a peer may take."""


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", RANK)


def chunk(i: int, value: float) -> StoredChunk:
    return StoredChunk(key(i), np.full(LAYOUT.shape, value, dtype=np.float32))


class Holder(NamedTuple):
    instance_id: str
    tier: str
    backend: str
    shared: bool


def in_l1(instance_id: str) -> Holder:
    return Holder(instance_id, "l1", "dram", False)


class Fleet:
    """Placements as listed (order kept) and a real :class:`PeerClient` per peer with a URL."""

    def __init__(
        self,
        holders: dict[ObjectKey, list[Holder]],
        urls: dict[str, str],
        deadline: float = DEADLINE,
    ) -> None:
        self._holders = holders
        self._peers = {
            i: PeerClient(url, max_chunk_bytes=max_chunk_bytes(LAYOUT), deadline=deadline)
            for i, url in urls.items()
        }

    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]:
        return [self._holders.get(k, []) for k in keys]

    def peer(self, instance_id: str) -> PeerClient | None:
        return self._peers.get(instance_id)

    def close(self) -> None:
        for client in self._peers.values():
            client.close()


class Silent:
    """A peer on a real socket that accepts, reads the request and then sends nothing
    (``drip``: the status line, then a byte every 50 ms), for longer than any deadline."""

    def __init__(self, drip: bool) -> None:
        self.drip = drip
        self.accepted = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                if self.drip:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n"
                    )  # within the reply bound
                for _ in range(1200):  # a minute, unless the client hangs up or we stop
                    if self._stop.wait(0.05):
                        return
                    if self.drip:
                        conn.sendall(b"\x91")
            except OSError:
                return  # the client gave up: the point

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.fixture
def real_peer() -> Iterator[tuple[str, L1Cache]]:
    """A real peer process-in-a-thread: its L1 served over ``/peer/kv``."""
    l1 = L1Cache(1 << 20)
    server = PeerServer(create_peer_app(l1), port=free_port()).start()
    try:
        yield server.url, l1
    finally:
        server.stop()


def tiered(
    tmp_path: Path, fleet: Fleet, counters: Counter[str], clock: Callable[[], float]
) -> TieredFetch:
    from kvatlas.node.peer_health import PeerHealth

    l2 = FsL2(tmp_path / "l2")
    return TieredFetch(
        L1Cache(1 << 20), l2, fleet, instance_id="me", layout=LAYOUT,
        on_l1_hit=lambda _: None, counters=counters,
        health=PeerHealth(10.0, 40.0, clock=clock, jitter=lambda: 1.0),
    )  # fmt: skip


@pytest.mark.parametrize("ghost", ["empty", "no_url", "refused"])
def test_a_ghost_listed_first_does_not_cost_the_real_peers_l1_copy(
    tmp_path: Path, real_peer: tuple[str, L1Cache], ghost: str
) -> None:
    """The directory lists a ghost first (a live peer that lost the chunk, an instance
    without a URL, a port nobody listens on), then the real holder; this node's own L2 has a
    copy too. The chunk comes from the real peer's L1, counted as a fallback hit."""
    real_url, real_l1 = real_peer
    real_l1.put(chunk(1, 1.0))
    urls = {"real": real_url}
    empty_l1 = L1Cache(1 << 20)
    empty = PeerServer(create_peer_app(empty_l1), port=free_port()).start()
    if ghost == "empty":
        urls["ghost"] = empty.url
    elif ghost == "refused":
        urls["ghost"] = f"http://127.0.0.1:{free_port()}"
    fleet = Fleet({key(1): [in_l1("ghost"), in_l1("real")]}, urls, SERVED)
    counters: Counter[str] = Counter()
    try:
        tiers = tiered(tmp_path, fleet, counters, lambda: 0.0)
        assert tiers.l2 is not None
        tiers.l2.put(chunk(1, 2.0))  # the slower copy

        found = tiers.fetch([key(1)])

        assert found[key(1)].source == "peer_l1" and found[key(1)].origin == "real"
        assert np.all(found[key(1)].chunk.kv == 1.0)
        assert counters["peer_fallback_hits"] == 1
    finally:
        fleet.close()
        empty.stop()


@pytest.mark.parametrize("drip", [False, True], ids=["silent", "dripping"])
def test_a_dripping_peer_costs_its_deadline_once_per_down_time(
    tmp_path: Path, real_peer: tuple[str, L1Cache], drip: bool
) -> None:
    """The dripping peer is listed first for a chunk the real peer also holds. The first
    fetch waits out its deadline, then the real peer serves; until the down-time passes the
    dripping peer is not even connected to; then it is tried again, and failing again, it is
    down for twice as long."""
    real_url, real_l1 = real_peer
    real_l1.put(chunk(1, 1.0))
    slow = Silent(drip)
    fleet = Fleet({key(1): [in_l1("slow"), in_l1("real")]}, {"slow": slow.url, "real": real_url})
    counters: Counter[str] = Counter()
    now = [0.0]
    try:
        tiers = tiered(tmp_path, fleet, counters, lambda: now[0])

        def fetch() -> str:
            found = tiers.fetch([key(1)])
            return found[key(1)].origin

        assert fetch() == "real"
        assert (slow.accepted, counters["peer_fetch_deadline"]) == (1, 1)
        for _ in range(5):  # down: skipped, not connected to, no deadline spent
            assert fetch() == "real"
        assert (slow.accepted, counters["peer_fetch_deadline"]) == (1, 1)
        assert counters["peer_skipped_down"] == 5
        assert tiers.prefix_hits([key(1)]) == 1  # the real peer's copy still counts

        now[0] = 10.0  # its first down-time (10 s, no jitter here) has passed: tried again
        assert fetch() == "real"
        assert (slow.accepted, counters["peer_fetch_deadline"]) == (2, 2)
        now[0] = 29.9  # failed again: down for 20 s now
        assert fetch() == "real"
        assert slow.accepted == 2
        now[0] = 30.0
        assert fetch() == "real"
        assert (slow.accepted, counters["peer_fetch_deadline"]) == (3, 3)
        assert counters["peer_fallback_hits"] == 9  # every fetch served by the second holder
    finally:
        fleet.close()
        slow.close()


def test_a_peer_that_answers_again_is_forgotten() -> None:
    from kvatlas.node.peer_health import PeerHealth

    now = [0.0]
    health = PeerHealth(1.0, 4.0, clock=lambda: now[0], jitter=lambda: 1.0, max_peers=2)
    health.failed("p", "deadline")
    assert health.down("p") and not health.down("q")
    now[0] = 1.0
    assert not health.down("p")
    health.failed("p", "deadline")  # the step doubled: down until 3.0
    now[0] = 2.9
    assert health.down("p")
    health.succeeded("p")
    assert not health.down("p") and len(health) == 0
    health.failed("p", "refused")  # a new outage starts from the initial step again
    now[0] = 3.8
    assert health.down("p")
    now[0] = 3.9
    assert not health.down("p")
    # bounded: a flood of failing ids never grows the memory past max_peers
    for i in range(10):
        health.failed(f"flood-{i}", "unreachable")
        assert len(health) <= 2


def test_a_peer_that_sends_another_layouts_chunks_is_down_for_a_while(
    tmp_path: Path, real_peer: tuple[str, L1Cache]
) -> None:
    """A peer that registered no layout (an older node) sends a float16 chunk to this float32
    node: refused (``fetched_wrong_layout``), and the peer is down as a failing one is, so
    lookups stop counting its copies (each would be a claim whose load fails) until its
    down-time passes."""
    url, l1 = real_peer
    l1.put(StoredChunk(key(1), np.full(LAYOUT.shape, 1.0, dtype=np.float16)))
    fleet = Fleet({key(1): [in_l1("other")]}, {"other": url}, SERVED)
    counters: Counter[str] = Counter()
    now = [0.0]
    try:
        tiers = tiered(tmp_path, fleet, counters, lambda: now[0])
        assert tiers.prefix_hits([key(1)]) == 1  # (nothing says its layout yet)
        assert tiers.fetch([key(1)]) == {}
        assert counters["fetched_wrong_layout"] == 1
        assert tiers.prefix_hits([key(1)]) == 0
        now[0] = 11.0  # past the first down-time: asked again, and down again
        assert tiers.prefix_hits([key(1)]) == 1
        assert tiers.fetch([key(1)]) == {} and tiers.prefix_hits([key(1)]) == 0
    finally:
        fleet.close()
