"""Resync by inventory digests (convergence.md §3): the directory's digests follow its
placements exactly, a ``resync`` batch replaces exactly its prefixes, and over HTTP a node that
was fenced, or a coordinator that restarted, converges through a digest exchange."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from blake3 import blake3

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.events import (
    ACCESS,
    DELETE,
    RESYNC,
    STORE,
    CacheEntry,
    EventBatch,
    EventValidationError,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)
from kvatlas.events.inventory import digest_of, placement_element
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.config import NodeConfig
from kvatlas.node.server import NodeProcess
from tests.conftest import wait_for
from tests.coordinator.helpers import (
    CS,
    hashes,
    running,
    wire_batch,
    wire_entry,
    wire_key,
)
from tests.directory.helpers import Emitter, toks
from tests.helpers import TINY, write_tokens
from tests.helpers import node_config as toy_config

Own = dict[tuple[str, str], dict[ObjectKey, str]]  # (instance, tier) -> key -> backend


def hkey(first: int, n: int, salt: str = "") -> ObjectKey:
    """A key whose chunk hash starts with ``first``, the rest pseudo-random (like a real one)."""
    h = bytes([first]) + blake3(n.to_bytes(8, "little")).digest()[:31]
    return ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0), 0, salt)


def expected(own: Own, inst: str, tier: str) -> list[int]:
    held = own.get((inst, tier), {})
    return digest_of(b"", ((k.chunk_hash, placement_element(k, tier, b)) for k, b in held.items()))


def test_digests_follow_store_delete_fence_resync_and_restore(tmp_path: Path) -> None:
    rng = random.Random(7)
    d = KeyDirectory(4)
    emitters = {i: Emitter(i) for i in ("a", "b")}
    own: Own = {}
    keys = [hkey(rng.randrange(4), n, salt=rng.choice(["", "s"])) for n in range(60)]
    where = [("l1", "dram"), ("gpu", "hbm"), ("l2", "fs")]  # (a fence drops l1 and gpu)
    for step in range(400):
        inst = rng.choice(["a", "b"])
        tier, backend = rng.choice(where)
        em = emitters[inst]
        held = own.setdefault((inst, tier), {})
        op = rng.random()
        if op < 0.5:
            ks = rng.sample(keys, 5)
            d.consume(em.batch(STORE, [CacheEntry(k, 8) for k in ks], tier, backend))
            held.update({k: backend for k in ks})
        elif op < 0.8:
            ks = rng.sample(keys, 5)
            d.consume(em.batch(DELETE, [CacheEntry(k, 8) for k in ks], tier, backend))
            for k in ks:
                held.pop(k, None)
        elif op < 0.85:  # a fence: by hand, a deregistration or a restart (a higher incarnation)
            how = rng.choice(["fence", "deregister", "restart"])
            if how == "fence":
                d.fence_instance(inst)
            elif how == "deregister":
                d.deregister(inst)
            else:
                em.restart()
                d.consume(em.batch(ACCESS, [], tier, backend))
            own.pop((inst, "l1"), None)
            own.pop((inst, "gpu"), None)
        elif op < 0.95:
            first = rng.randrange(4)
            listed = [k for k in rng.sample(keys, 8) if k.chunk_hash[0] == first]
            batch = em.batch(
                RESYNC,
                [CacheEntry(k, 8) for k in listed],
                tier,
                backend,
                prefixes=(f"{first:02x}",),
            )
            d.consume(batch)
            for k in [k for k in held if k.chunk_hash[0] == first]:
                del held[k]
            held.update({k: backend for k in listed})
        else:  # a shared pool copy never counts in anyone's digest
            d.consume(em.batch(STORE, [CacheEntry(rng.choice(keys), 8)], "l2", "pool", True))
        for i in ("a", "b"):
            for t, _ in where:
                assert d.digest(i, t) == expected(own, i, t), (step, i, t)
    assert any(d.digest("a", "l2")) and any(d.digest("b", "l2"))  # not trivially equal
    path = tmp_path / "snap"
    save_snapshot(d, path)
    restored = KeyDirectory(4)
    load_snapshot(restored, path)
    # changes before the digests are first built (lazily, after a restore) are counted once
    extra = hkey(9, 999)
    later = Emitter("a", incarnation=emitters["a"].incarnation + 1)
    restored.consume(later.batch(STORE, [CacheEntry(extra, 8)], "l2", "fs"))
    own.setdefault(("a", "l2"), {})[extra] = "fs"
    own.pop(("a", "l1"), None)  # the new incarnation fenced a's L1 (and GPU) first
    own.pop(("a", "gpu"), None)
    for i in ("a", "b"):
        for t, _ in where:
            assert restored.digest(i, t) == expected(own, i, t)
    # the one-byte prefix digest is the root bucket split by the second byte
    for first in range(4):
        sub = d.digest("a", "l1", bytes([first]))
        root = 0
        for b in sub:
            root ^= b
        assert root == d.digest("a", "l1")[first]


def test_resync_replaces_exactly_its_prefixes_and_keeps_the_index_consistent() -> None:
    d = KeyDirectory(4, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    inside, ghost, outside, other = hkey(1, 1), hkey(1, 2), hkey(2, 1), hkey(1, 3)
    content = toks(1, 2, 3, 4)
    d.consume(a.batch(STORE, [CacheEntry(inside, 8), CacheEntry(ghost, 8, content, 0)]))
    d.consume(a.batch(STORE, [CacheEntry(outside, 8)]))
    d.consume(a.batch(STORE, [CacheEntry(ghost, 8)], "l2", "fs"))  # another tier: untouched
    d.consume(b.batch(STORE, [CacheEntry(ghost, 8)]))  # another instance: untouched
    d.consume(a.batch(STORE, [CacheEntry(other, 8)], "l1", "pool", True))  # shared: untouched
    assert d.blend_match(content, ghost_ns()) != []
    new = hkey(1, 4)
    d.consume(
        a.batch(
            RESYNC,
            [CacheEntry(inside, 8), CacheEntry(new, 8, toks(5, 6, 7, 8), 0)],
            prefixes=("01",),
        )
    )
    holders = {
        k: {(p.instance_id, p.tier, p.shared) for p in r.placements}
        for k, r in zip(
            (inside, ghost, outside, other, new),
            d.lookup([inside, ghost, outside, other, new]),
            strict=True,
        )
    }
    assert holders[inside] == {("a", "l1", False)}
    assert holders[ghost] == {("a", "l2", False), ("b", "l1", False)}
    assert holders[outside] == {("a", "l1", False)}
    assert holders[other] == {("a", "l1", True)}
    assert holders[new] == {("a", "l1", False)}
    assert d.stats().l1_placements_by_instance == {"a": 3, "b": 1}
    assert d.blend_match(toks(5, 6, 7, 8), ghost_ns()) != []
    # the ghost's content is still held by b and a's L2: still matchable
    assert d.blend_match(content, ghost_ns()) != []
    d.fence_instance("a")
    assert d.stats().l1_placements_by_instance == {"b": 1}
    assert d.digest("a", "l1") == [0] * 256


def ghost_ns():  # type: ignore[no-untyped-def]
    from kvatlas.keys import BlendNamespace

    return BlendNamespace("m", "", 1)


def test_resync_batch_validation_and_codecs() -> None:
    k = hkey(0xAB, 1)
    batch = EventBatch("a", 1, 1, RESYNC, "l1", "dram", entries=(CacheEntry(k, 3),),
                       prefixes=("ab", "cd01"))  # fmt: skip
    for encode, decode in ((encode_json, decode_json), (encode_msgpack, decode_msgpack)):
        (back,) = decode(encode([batch]))
        assert back == batch and back.prefixes == ("ab", "cd01")
    bad = [
        dict(prefixes=None),
        dict(prefixes=()),
        dict(prefixes=("abc",)),
        dict(prefixes=("zz",)),
        dict(prefixes=("cd",)),  # the entry lies outside
    ]
    for kw in bad:
        with pytest.raises(EventValidationError):
            EventBatch("a", 1, 1, RESYNC, "l1", "dram", entries=(CacheEntry(k, 3),), **kw)
    with pytest.raises(EventValidationError, match="prefixes"):
        EventBatch("a", 1, 1, STORE, "l1", "dram", prefixes=("ab",))
    with pytest.raises(EventValidationError, match="backend"):
        EventBatch("a", 1, 1, RESYNC, "l1", "", prefixes=("ab",))


# ---------------------------------------------------------------------------- over HTTP


class FakeClock:
    """The coordinator's heartbeat clock, moved by the test (no wall-clock waits)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def node_config(tmp_path: Path, url: str, **kw: Any) -> NodeConfig:
    return toy_config(**{"model_name": "m", **TINY, "chunk_size": CS, "coordinator_url": url,
                         "port": free_port(), "coordinator_event_reporting": True,
                         "instance_id": "n1", **kw})  # fmt: skip


def store_chunks(process: NodeProcess, first_token: int, n: int) -> list[bytes]:
    """Store ``n`` chunks in the node's L1 and deliver the events; returns their hashes."""
    node = process.node
    tracker = node.tracker(token_ids=list(range(first_token, first_token + n * CS)))
    kv = np.zeros(node.layout.shape, dtype=node.layout.numpy_dtype())
    assert node.store(tracker, [kv] * n) == n
    node.flush_events()
    assert process.sink is not None and process.sink.flush(10)
    return list(tracker.chunk_hashes())


def l1_holders(client: httpx.Client, hashes: list[bytes]) -> list[set[str]]:
    keys = [wire_key(h) for h in hashes]
    reply = client.post("/directory/lookup", json={"keys": keys}).json()
    return [
        {p["instance_id"] for p in r["placements"] if p["tier"] == "l1"} for r in reply["results"]
    ]


def visible(client: httpx.Client, hashes: list[bytes]) -> bool:
    return all(h == {"n1"} for h in l1_holders(client, hashes))


def test_a_node_fenced_by_timeout_re_registers_and_its_chunks_become_visible_again(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    with running(clock, instance_timeout=30.0) as (server, client):
        # The node's own digest exchanges re-report what a fence dropped: the one it starts
        # with must be over before the fence, and no periodic one may fall in the test.
        process = NodeProcess(node_config(tmp_path, server.url, digest_interval_s=3600.0))
        try:
            assert process.coordinator is not None and process.resync is not None
            process.coordinator.stop_heartbeat()  # the test heartbeats by hand
            resync = process.resync
            assert wait_for(lambda: resync.exchanges == 1 and not resync.wanted.is_set())
            hashes = store_chunks(process, 100, 3)
            assert wait_for(lambda: visible(client, hashes))
            clock.now += 31  # heartbeats missed (the node paused, its memory kept)
            # The coordinator's own sweep (once a second, same clock) may expire it first: then
            # this call finds nothing to expire, and the sweep's fence may still be running.
            registry = server.service.instances
            assert registry.expire() in (["n1"], [])
            assert registry.expired_total == 1 and not registry.known("n1")  # expired once
            assert wait_for(lambda: l1_holders(client, hashes) == [set()] * 3)  # fenced
            process.coordinator.heartbeat()  # 404 -> re-registers
            assert wait_for(lambda: visible(client, hashes)), l1_holders(client, hashes)
        finally:
            process.close()


@contextmanager
def coordinator_at(port: int, **config: Any) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    """A coordinator on ``port`` (a restarted one must be found where the node looks). Its
    tests heartbeat by hand: no timer fences the node (``instance_timeout``), as a slow run's
    30 s default did before their "not yet" assertions."""
    config = {"instance_timeout": 3600.0, **config}
    with (
        BackgroundServer(CoordinatorConfig(port=port, chunk_size=CS, **config)) as server,
        httpx.Client(base_url=server.url, timeout=30.0) as client,
    ):
        yield server, client


def test_coordinator_restart_on_http_converges_through_digests(tmp_path: Path) -> None:
    snap = tmp_path / "dir.snap"
    port = free_port()
    with coordinator_at(port, snapshot_path=snap) as (server, client):
        # exchanges by hand only: a timed one (30 s) in a slow run lists ``after`` early
        process = NodeProcess(node_config(tmp_path, server.url, digest_interval_s=3600.0))
        assert process.coordinator is not None
        process.coordinator.stop_heartbeat()
        before = store_chunks(process, 100, 2)
        assert wait_for(lambda: visible(client, before))
        assert server.service.take_snapshot() is not None
        kept = snap.read_bytes()
        after = store_chunks(process, 500, 3)  # applied, then lost with the process
        assert wait_for(lambda: visible(client, after))
    snap.write_bytes(kept)  # a crash: the snapshot taken at stop never happened
    try:
        with coordinator_at(port, snapshot_path=snap) as (server, client):
            assert visible(client, before) and not visible(client, after)
            process.coordinator.heartbeat()  # the reply asks for a digest exchange
            assert wait_for(lambda: visible(client, before + after)), l1_holders(client, after)
            assert not server.service.instances.owing()
    finally:
        process.close()


def test_a_restart_on_http_is_not_ready_until_the_live_instances_resynced(tmp_path: Path) -> None:
    """Restored from a snapshot, the coordinator may miss what was posted after it: ``/readyz``
    says ``resyncing`` (503) until every live instance exchanged digests, then ``serving``; a
    start without a snapshot has nothing to miss."""
    snap = tmp_path / "dir.snap"
    port = free_port()
    with coordinator_at(port, snapshot_path=snap) as (server, client):
        assert client.get("/readyz").json() == {"ready": True, "state": "serving"}
        # exchanges by hand only: a timed one (30 s) in a slow run would end "resyncing" early
        process = NodeProcess(node_config(tmp_path, server.url, digest_interval_s=3600.0))
        assert process.coordinator is not None
        process.coordinator.stop_heartbeat()
        before = store_chunks(process, 100, 2)
        assert wait_for(lambda: visible(client, before))
    try:
        with coordinator_at(port, snapshot_path=snap) as (server, client):
            assert client.get("/readyz").json() == {"ready": False, "state": "resyncing"}
            after = store_chunks(process, 500, 1)  # events keep flowing meanwhile
            assert wait_for(lambda: visible(client, after))
            assert client.get("/readyz").status_code == 503  # no exchange yet
            process.coordinator.heartbeat()  # the reply asks for a digest exchange
            assert wait_for(lambda: client.get("/readyz").status_code == 200)
            assert client.get("/readyz").json() == {"ready": True, "state": "serving"}
            assert visible(client, before + after)
    finally:
        process.close()


def test_instances_silent_past_the_timeout_after_a_restart_are_fenced(tmp_path: Path) -> None:
    snap = tmp_path / "dir.snap"
    h = hashes(list(range(40, 40 + CS)))[0]
    with running(snapshot_path=snap) as (server, client):
        client.post("/instances", json={"instance_id": "ghost"}).raise_for_status()
        batch = wire_batch("ghost", 1, 1, entries=[wire_entry(wire_key(h))])
        client.post("/events", json={"batches": [batch]}).raise_for_status()
    clock = FakeClock()
    with running(clock, snapshot_path=snap, instance_timeout=30.0) as (server, client):
        assert l1_holders(client, [h]) == [{"ghost"}]  # restored, not yet timed out
        clock.now += 31  # the ghost died while the coordinator was down: never heard again
        server.service.instances.expire()
        assert l1_holders(client, [h]) == [set()]
        assert "ghost" not in {r.instance_id for r in server.service.instances_view() if r.alive}


def test_a_restart_longer_than_the_timeout_does_not_fence_live_instances(
    tmp_path: Path,
) -> None:
    """A node's heartbeats cannot reach a coordinator that is down: a restart that took
    longer than ``--instance-timeout`` (or came long after the last snapshot) is not the
    node's silence. Restored instances used to keep their age, downtime included, so the
    first sweep fenced every live node (its L1 copies dropped, a move in flight failed).
    Now each has a full timeout from the restart to be heard from; one that is not is
    fenced then."""
    snap = tmp_path / "dir.snap"
    h = hashes(list(range(40, 40 + CS)))[0]
    with running(snapshot_path=snap) as (server, client):
        for name in ("live", "ghost"):
            client.post("/instances", json={"instance_id": name}).raise_for_status()
            batch = wire_batch(name, 1, 1, entries=[wire_entry(wire_key(h))])
            client.post("/events", json={"batches": [batch]}).raise_for_status()
    time.sleep(0.6)  # the coordinator was down longer than the timeout below
    clock = FakeClock()
    with running(clock, snapshot_path=snap, instance_timeout=0.5) as (server, client):
        server.service.instances.expire()  # the first sweep
        assert l1_holders(client, [h]) == [{"live", "ghost"}]
        clock.now += 0.3
        assert client.put("/instances/live/heartbeat").status_code == 200
        assert server.service.instances.expire() == []  # within its timeout: not yet
        clock.now += 0.3  # ghost: silent for a whole timeout since the restart
        assert server.service.instances.expire() == ["ghost"]
        assert l1_holders(client, [h]) == [{"live"}]


def test_a_snapshot_without_a_registry_still_loads(tmp_path: Path) -> None:
    d = KeyDirectory(4)
    d.consume(Emitter("a").batch(STORE, [CacheEntry(hkey(1, 1), 8)]))
    info = save_snapshot(d, tmp_path / "s")  # no registry, as before it was saved
    restored = KeyDirectory(4)
    assert load_snapshot(restored, tmp_path / "s").instances is None
    assert restored.digest("a", "l1") == d.digest("a", "l1") != [0] * 256
    assert info.instances is None


def test_the_digest_route_validates_and_a_gap_asks_for_an_exchange() -> None:
    zero = "00" * 2048
    with running() as (_, client):
        client.post("/instances", json={"instance_id": "g"}).raise_for_status()
        assert client.put("/instances/g/heartbeat").json() == {"instance_id": "g", "ok": True}
        url = "/instances/g/digest"
        for bad in (
            {"tiers": {"l3": {"": zero}}},
            {"tiers": {"l1": {"": zero[:-2]}}},
            {"tiers": {"l1": {"abcd": zero}}},
            {"tiers": {"l1": {"": "zz" * 2048}}},
            {"tiers": []},
        ):
            assert client.post(url, json=bad).status_code == 422, bad
        reply = client.post(url, json={"tiers": {"l1": {"": zero}, "l2": {"": zero}}})
        assert reply.json() == {"instance_id": "g", "tiers": {"l1": [], "l2": []}}
        h = hashes(list(range(60, 60 + CS)))[0]
        entry = wire_entry(wire_key(h))
        for seq in (1, 3):  # seq 2 never arrives: a gap
            batch = wire_batch("g", 1, seq, entries=[entry])
            client.post("/events", json={"batches": [batch]}).raise_for_status()
        assert client.put("/instances/g/heartbeat").json()["resync"] is True
        reply = client.post(url, json={"tiers": {"l1": {"": zero}}}).json()
        assert reply["tiers"]["l1"] == [h[:1].hex()]  # the coordinator holds what g does not
        assert "resync" not in client.put("/instances/g/heartbeat").json()  # gap seen


def test_an_emit_token_may_only_exchange_its_own_digests(tmp_path: Path) -> None:
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {
            "token": "emit-token-for-a-0123456789abcdef0123456789",
            "roles": ["emit"],
            "instance_ids": ["a"],
        },
    )
    with running(auth_token_file=tokens) as (_, client):
        body = {"tiers": {"l1": {"": "00" * 2048}}}
        headers = {"Authorization": "Bearer emit-token-for-a-0123456789abcdef0123456789"}
        assert client.post("/instances/a/digest", json=body, headers=headers).status_code == 200
        assert client.post("/instances/b/digest", json=body, headers=headers).status_code == 403
        assert client.post("/instances/a/digest", json=body).status_code == 401


def test_an_empty_node_clears_stale_placements_under_its_name(tmp_path: Path) -> None:
    """Five placements under the node's name that the node does not hold (sent through its
    own sink, behind its inventory's back, as a previous life's stores whose deletes were
    lost): the node holds nothing under the differing prefixes, its resync still sends those
    prefixes (with no entries), and the directory converges to zero."""
    with running() as (server, client):
        process = NodeProcess(node_config(tmp_path, server.url))
        try:
            assert process.sink is not None and process.resync is not None
            stale = [hkey(17 * i, i) for i in range(5)]
            hashes = [k.chunk_hash for k in stale]
            assert wait_for(lambda: process.resync.exchanges >= 1)  # the exchange at start
            backend = process.resync.backends["l1"]
            assert process.sink.emit(STORE, "l1", backend, [CacheEntry(k, 8) for k in stale])
            assert process.sink.flush(10)
            assert wait_for(lambda: l1_holders(client, hashes) == [{"n1"}] * 5)
            report = process.resync.run_once()
            assert report.prefixes >= 1 and report.batches >= 1 and report.entries == 0
            assert wait_for(lambda: l1_holders(client, hashes) == [set()] * 5), l1_holders(
                client, hashes
            )
        finally:
            process.close()
