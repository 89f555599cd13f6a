"""Node storage is bounded and honest (issue 11, convergence.md §4): the fs L2 byte cap evicts
least-recently-used chunks and reports each as a delete; a restart rescans the private fs L2
and reports what is really there; corrupt or partial files are deleted, counted, never served;
Redis L2 expirations and evictions (keyspace notifications, else the sweep) reach a real
coordinator as deletes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import redis

from kvatlas.client import CoordinatorClient, EventSink, HttpTransport, InProcessTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.directory import KeyDirectory
from kvatlas.keys import ObjectKey
from kvatlas.node.cache_node import CacheNode, HeldPlacement
from kvatlas.node.config import NodeConfig
from kvatlas.node.l2 import FsL2, FsL2Stats, L2FullOfPins, L2Unavailable, RedisL2
from kvatlas.node.pins import PinnedKeys
from kvatlas.node.stored_chunk import StoredChunk, encode_chunk
from tests.conftest import RedisServer, wait_for
from tests.helpers import TINY, node_config

C = 16


config = partial(node_config, **TINY)


CFG = config()


def prompt(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * C).astype(np.uint32)


def kv_chunks(cfg: NodeConfig, n: int) -> list[np.ndarray]:
    return [np.full(cfg.layout.shape, i, dtype=np.float32) for i in range(n)]


def keys_of(node: CacheNode, tokens: np.ndarray) -> list[ObjectKey]:
    return [node.key(h, "") for h in node.tracker(token_ids=tokens).chunk_hashes()]


def encoded_size(node: CacheNode) -> int:
    """Bytes of one stored chunk file of ``node``'s layout (all chunks here have one size)."""
    tokens = np.zeros(C, dtype=np.uint32)
    sample = StoredChunk(node.key(b"\0" * 32, ""), kv_chunks(node.config, 1)[0], tokens, 0)
    return len(encode_chunk(sample))


class InProcessNode:
    """A CacheNode whose events go to a real directory in this process."""

    def __init__(self, l2: FsL2, cfg: NodeConfig = CFG, instance_id: str = "n1") -> None:
        self.directory = KeyDirectory(C)
        self.sink = EventSink(instance_id, InProcessTransport(self.directory.consume))
        self.node = CacheNode(cfg, instance_id=instance_id, l2=l2, sink=self.sink)

    def placements(self, keys: list[ObjectKey], tier: str) -> set[ObjectKey]:
        self.node.flush_events()
        assert self.sink.flush(30)
        return {
            kp.key
            for kp in self.directory.lookup(keys)
            if any(p.tier == tier and p.instance_id == "n1" for p in kp.placements)
        }

    def close(self) -> None:
        self.node.close()
        self.sink.close()


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 1 << 24 | 1 << 8)


def chunk(i: int) -> StoredChunk:
    return StoredChunk(key(i), np.full(8, i, dtype=np.float32), np.arange(4, dtype=np.uint32), 0)


# -- fs: cap and LRU ---------------------------------------------------------------------


def test_fs_cap_evicts_least_recently_used_first_and_reports_each(tmp_path: Path) -> None:
    size = len(encode_chunk(chunk(0)))
    lost: list[tuple[ObjectKey, str]] = []
    l2 = FsL2(tmp_path, max_bytes=3 * size)
    l2.attach(lambda c: True, lambda k, cause: lost.append((k, cause)))
    for i in range(3):
        l2.put(chunk(i))
    assert lost == []
    assert l2.get(key(0)) is not None  # a read makes 0 the most recently used
    l2.put(chunk(3))
    assert lost == [(key(1), "evicted")]
    l2.put(chunk(2))  # a rewrite is a use too
    l2.put(chunk(4))
    assert lost == [(key(1), "evicted"), (key(0), "evicted")]
    on_disk = list(tmp_path.glob("*/*.kvc"))
    assert len(on_disk) == 3 and sum(p.stat().st_size for p in on_disk) <= 3 * size
    assert {k for k in map(key, range(5)) if l2.contains(k)} == {key(2), key(3), key(4)}
    assert l2.stats() == FsL2Stats(3, 3 * size, 3 * size, evicted=2, corrupt_deleted=0)
    big = StoredChunk(key(9), np.zeros(4 * size, dtype=np.uint8).view(np.float32))
    with pytest.raises(L2Unavailable, match="larger than the cap"):
        l2.put(big)
    assert not l2.contains(key(9)) and len(lost) == 2


def test_fs_cap_never_evicts_pinned_keys_and_refuses_when_only_pins_would_make_room(
    tmp_path: Path,
) -> None:
    """The operator's pins (``FsL2.pinned``, kept by the node from the coordinator): the cap
    passes them by; a put that only pinned files could make room for is refused, nothing
    evicted; unpinned, they go first again."""
    size = len(encode_chunk(chunk(0)))
    lost: list[ObjectKey] = []
    l2 = FsL2(tmp_path, max_bytes=3 * size)
    l2.attach(lambda c: True, lambda k, cause: lost.append(k))
    pins = PinnedKeys([key(0)])
    l2.pinned = pins
    for i in range(4):
        l2.put(chunk(i))
    assert lost == [key(1)]  # 0 is the least recently used, but pinned
    pins.replace([key(0), key(2), key(3)])
    with pytest.raises(L2FullOfPins, match="pinned"):
        l2.put(chunk(4))
    assert lost == [key(1)] and not l2.contains(key(4))
    assert all(l2.contains(key(i)) for i in (0, 2, 3))
    pins.replace([])
    l2.put(chunk(4))
    assert lost == [key(1), key(0)]


def test_a_put_into_a_full_l2_never_puts_more_than_the_cap_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room is made before the new file is written, not after (the soak sampled a private
    L2 one file over its cap: the file landed, then the eviction ran). Checked at the moment
    the file is renamed into place, temp file included before, final file after."""
    size = len(encode_chunk(chunk(0)))
    l2 = FsL2(tmp_path, max_bytes=3 * size)
    l2.attach(lambda c: True, lambda k, cause: None)
    seen: list[int] = []
    real_replace = os.replace

    def on_disk() -> int:
        return sum(p.stat().st_size for p in tmp_path.glob("*/*") if p.is_file())

    def replace(src: str, dst: str) -> None:
        seen.append(on_disk())
        real_replace(src, dst)
        seen.append(on_disk())

    monkeypatch.setattr(os, "replace", replace)
    for i in range(6):
        l2.put(chunk(i))
    assert len(seen) == 12 and max(seen) <= 3 * size, (seen, 3 * size)
    assert l2.stats().files == 3 and l2.stats().evicted == 3


def test_a_private_l2_removes_a_crashed_writes_temp_file_at_start(tmp_path: Path) -> None:
    """Found by ``kvatlas soak``: a node killed during an L2 write left its temp file, which
    the restarted node kept for an hour (only temp files that old were swept): its disk held
    one file over the cap. A private L2 has one writer, the node starting now: every temp file
    is a dead write. A shared pool keeps young ones (other nodes may be writing them)."""
    size = len(encode_chunk(chunk(0)))
    for shared in (False, True):
        root = tmp_path / ("pool" if shared else "private")
        (root / "ab").mkdir(parents=True)
        orphan = root / "ab" / ".tmp-crashed.part"
        orphan.write_bytes(b"\0" * size)  # young: written just now, by a writer now dead
        FsL2(root, shared=shared, max_bytes=0 if shared else 3 * size)
        assert orphan.exists() is shared


def test_fs_cap_is_for_private_l2_only() -> None:
    with pytest.raises(ValueError, match="private"):
        FsL2(Path("/nonexistent-never-created"), shared=True, max_bytes=1)
    with pytest.raises(ValueError, match="l2-max-bytes"):
        config(l2_max_bytes=-1)


def test_node_over_its_l2_cap_reports_each_eviction_as_a_delete(tmp_path: Path) -> None:
    probe = CacheNode(CFG, instance_id="probe")
    size = encoded_size(probe)
    l2 = FsL2(tmp_path / "n1", max_bytes=5 * size)
    n = InProcessNode(l2)
    try:
        tokens = prompt(1, 8)
        assert n.node.store(n.node.tracker(token_ids=tokens), kv_chunks(CFG, 8)) == 8
        keys = keys_of(n.node, tokens)
        on_disk = {k for k in keys if l2.contains(k)}
        assert on_disk == set(keys[3:])  # the five most recent
        assert n.placements(keys, "l2") == on_disk  # the directory agrees: 3 deletes arrived
        assert n.placements(keys, "l1") == set(keys)  # L1 is not touched
        assert n.node.counters["l2_evicted"] == 3
        assert {p for p in n.node.inventory() if p.tier == "l2"} == {
            HeldPlacement(k, "l2", "fs") for k in on_disk
        }
    finally:
        n.close()


# -- fs: restart rescan, corrupt files ------------------------------------------------------


def test_restart_rescans_l2_reports_what_is_there_and_deletes_corrupt_files(
    tmp_path: Path,
) -> None:
    root = tmp_path / "n1"
    first = InProcessNode(FsL2(root))
    tokens = prompt(2, 6)
    keys = keys_of(first.node, tokens)
    first.node.store(first.node.tracker(token_ids=tokens), kv_chunks(CFG, 6))
    first.close()
    l2 = FsL2(root)
    truncated, bad_header = l2.path_for(keys[2]), l2.path_for(keys[4])
    truncated.write_bytes(truncated.read_bytes()[:-40])  # a partial write
    data = bytearray(bad_header.read_bytes())
    data[:4] = b"XXXX"
    bad_header.write_bytes(bytes(data))
    garbage = root / "ab" / ("ab" + "0" * 62 + ".kvc")
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(b"not a chunk")
    misnamed = root / keys[0].chunk_hash.hex()[:2] / "misnamed.kvc"
    misnamed.parent.mkdir(exist_ok=True)
    misnamed.write_bytes(l2.path_for(keys[0]).read_bytes())  # a good chunk under a wrong name

    second = InProcessNode(FsL2(root))  # the restart: new process, empty directory
    try:
        good = {keys[0], keys[1], keys[3], keys[5]}
        assert second.placements(keys, "l2") == good  # store events for what is really there
        assert second.placements(keys, "l1") == set()
        assert second.node.counters["l2_corrupt_deleted"] == 4
        assert second.node.counters["l2_rescanned"] == 4
        for gone in (truncated, bad_header, garbage, misnamed):
            assert not gone.exists()
        assert {p.key for p in second.node.inventory()} == good
        got = second.node.retrieve(second.node.tracker(token_ids=tokens))
        assert got.hit_tokens == 2 * C and got.sources == {"l2": 2}  # stops at the hole
        for i, kv in enumerate(got.kv):
            np.testing.assert_array_equal(kv, kv_chunks(CFG, 6)[i])
        assert second.node.l2 is not None
        assert isinstance(second.node.l2, FsL2)
        assert second.node.l2.stats().files == 4
    finally:
        second.close()


def test_a_lower_cap_after_restart_evicts_the_oldest_files_and_reports_them(
    tmp_path: Path,
) -> None:
    root = tmp_path / "n1"
    first = InProcessNode(FsL2(root))
    tokens = prompt(3, 4)
    keys = keys_of(first.node, tokens)
    first.node.store(first.node.tracker(token_ids=tokens), kv_chunks(CFG, 4))
    first.close()
    l2 = FsL2(root)
    for i, k in enumerate(keys):  # keys[0] newest ... keys[3] oldest
        t = 1_000_000 - i * 10
        os.utime(l2.path_for(k), (t, t))
    second = InProcessNode(FsL2(root, max_bytes=2 * encoded_size(first.node)))
    try:
        assert second.placements(keys, "l2") == {keys[0], keys[1]}
        assert not l2.path_for(keys[3]).exists() and not l2.path_for(keys[2]).exists()
        assert second.node.counters["l2_evicted"] == 2
    finally:
        second.close()


def in_l2_only(n: InProcessNode, seed: int) -> tuple[np.ndarray, list[ObjectKey], FsL2]:
    """Two chunks stored, the first then dropped from L1: its only copy is its L2 file."""
    tokens = prompt(seed, 2)
    keys = keys_of(n.node, tokens)
    n.node.store(n.node.tracker(token_ids=tokens), kv_chunks(CFG, 2))
    n.node.l1.remove(keys[0])
    assert isinstance(n.node.l2, FsL2)
    return tokens, keys, n.node.l2


def failing_reads(monkeypatch: pytest.MonkeyPatch, errors: dict[Path, int]) -> Callable[[], None]:
    """Reads of these files fail with these errnos (``open`` patched) until the returned
    function is called."""
    import builtins

    real_open, failing = builtins.open, {str(p): code for p, code in errors.items()}

    def flaky_open(file: object, *args: object, **kwargs: object) -> object:
        code = failing.get(str(file))
        if code is not None and (not args or "r" in str(args[0])):
            raise OSError(code, os.strerror(code), str(file))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", flaky_open)
    return lambda: monkeypatch.setattr(builtins, "open", real_open)


def test_a_corrupt_file_found_by_a_read_is_deleted_counted_and_reported(tmp_path: Path) -> None:
    n = InProcessNode(FsL2(tmp_path / "n1"))
    try:
        tokens, keys, l2 = in_l2_only(n, 4)
        path = l2.path_for(keys[0])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        got = n.node.retrieve(n.node.tracker(token_ids=tokens))
        assert got.hit_tokens == 0  # never served
        assert not path.exists()
        assert n.node.counters["l2_corrupt_deleted"] == 1
        assert n.placements(keys, "l2") == {keys[1]}
    finally:
        n.close()


def test_a_shared_pools_corrupt_file_deleted_by_another_node_is_reported(tmp_path: Path) -> None:
    """Node b finds the corrupt file node a wrote into the shared pool and deletes it: b's
    delete takes the pool's placement away (a never learns its file is gone; the directory
    kept promising a copy every retrieve misses)."""
    directory = KeyDirectory(C)
    sinks = [EventSink(i, InProcessTransport(directory.consume)) for i in ("a", "b")]
    a, b = (CacheNode(CFG, instance_id=s.instance_id, l2=FsL2(tmp_path / "pool", shared=True),
                      sink=s) for s in sinks)  # fmt: skip
    try:
        tokens = prompt(5, 2)
        keys = keys_of(a, tokens)
        a.store(a.tracker(token_ids=tokens), kv_chunks(CFG, 2))

        def pooled() -> set[ObjectKey]:
            for node, sink in ((a, sinks[0]), (b, sinks[1])):
                node.flush_events()
                assert sink.flush(30)
            return {kp.key for kp in directory.lookup(keys)
                    if any(p.tier == "l2" and p.shared for p in kp.placements)}  # fmt: skip

        assert pooled() == set(keys)
        assert isinstance(a.l2, FsL2)
        path = a.l2.path_for(keys[0])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        assert b.retrieve(b.tracker(token_ids=tokens)).hit_tokens == 0  # never served
        assert not path.exists() and b.counters["l2_corrupt_deleted"] == 1
        assert pooled() == {keys[1]}
    finally:
        for node in (a, b):
            node.close()
        for sink in sinks:
            sink.close()


# -- redis: TTL and eviction reach a real coordinator -----------------------------------------


@pytest.fixture(scope="module")
def coordinator() -> Iterator[BackgroundServer]:
    with BackgroundServer(CoordinatorConfig(port=free_port(), chunk_size=C)) as server:
        yield server


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone: its CONFIG may be changed."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def redis_node(
    coordinator: BackgroundServer, l2: RedisL2, cfg: NodeConfig, instance_id: str
) -> tuple[CacheNode, EventSink]:
    sink = EventSink(instance_id, HttpTransport(coordinator.url))
    return CacheNode(cfg, instance_id=instance_id, l2=l2, sink=sink), sink


def coordinator_holds(
    coordinator: BackgroundServer, keys: list[ObjectKey], instance_id: str, tier: str
) -> set[ObjectKey]:
    with CoordinatorClient(coordinator.url) as client:
        placements = [r.placements for r in client.lookup_keys(keys).results]
    return {
        k
        for k, pls in zip(keys, placements, strict=True)
        if any(p.instance_id == instance_id and p.tier == tier for p in pls)
    }


@pytest.mark.parametrize("notifications", [True, False], ids=["keyspace-events", "sweep"])
def test_redis_ttl_expiry_reaches_the_coordinator_as_deletes(
    coordinator: BackgroundServer, private_redis: RedisServer, notifications: bool
) -> None:
    raw = redis.Redis.from_url(private_redis.url)
    raw.config_set("notify-keyspace-events", "Ex" if notifications else "")
    raw.close()
    l2 = RedisL2(
        private_redis.url, prefix=f"t:{uuid.uuid4().hex}:", ttl_seconds=1,
        sweep_interval=3600 if notifications else 0.2,  # notifications alone must do it
    )  # fmt: skip
    instance = f"ttl-{uuid.uuid4().hex[:8]}"
    node, sink = redis_node(coordinator, l2, CFG, instance)
    try:
        tokens = prompt(5, 3)
        keys = keys_of(node, tokens)
        node.store(node.tracker(token_ids=tokens), kv_chunks(CFG, 3))
        assert wait_for(lambda: l2.notifications == notifications, timeout=30)
        assert wait_for(
            lambda: coordinator_holds(coordinator, keys, instance, "l2") == set(), timeout=60
        )
        assert coordinator_holds(coordinator, keys, instance, "l1") == set(keys)
        cause = "l2_expired" if notifications else "l2_vanished"
        assert node.counters[cause] == 3
        assert [p for p in node.inventory() if p.tier == "l2"] == []
    finally:
        node.close()
        sink.close()


def test_redis_eviction_under_maxmemory_reaches_the_coordinator_as_deletes(
    coordinator: BackgroundServer, private_redis: RedisServer
) -> None:
    cfg = config(num_layers=2, num_kv_heads=4, head_dim=64)  # 64 KiB of KV per chunk
    raw = redis.Redis.from_url(private_redis.url)
    raw.config_set("notify-keyspace-events", "Ee")
    raw.config_set("maxmemory-policy", "allkeys-lru")
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 1_000_000)
    l2 = RedisL2(private_redis.url, prefix=f"t:{uuid.uuid4().hex}:", sweep_interval=3600)
    instance = f"evict-{uuid.uuid4().hex[:8]}"
    node, sink = redis_node(coordinator, l2, cfg, instance)
    try:
        assert wait_for(lambda: l2.notifications, timeout=30)
        tokens = prompt(6, 40)  # ~2.6 MB: well past the cap
        keys = keys_of(node, tokens)
        node.store(node.tracker(token_ids=tokens), kv_chunks(cfg, 40))

        def in_redis() -> set[ObjectKey]:
            return {k for k in keys if raw.exists(l2.redis_key(k))}

        assert len(in_redis()) < len(keys)  # Redis did evict
        assert wait_for(
            lambda: coordinator_holds(coordinator, keys, instance, "l2") == in_redis(),
            timeout=60,
        )
        assert node.counters["l2_evicted"] == len(keys) - len(in_redis())
    finally:
        node.close()
        sink.close()
        raw.close()


class EvictedRightAfterWrite(FsL2):
    """An fs L2 that loses each chunk the moment it is written (another writer's eviction
    racing this one): the loss is reported before the node records its store."""

    def put(self, chunk: StoredChunk) -> None:
        super().put(chunk)
        self.delete(chunk.key)
        self._report([chunk.key], "evicted")


def test_a_chunk_lost_between_write_and_report_is_no_ghost(tmp_path: Path) -> None:
    n = InProcessNode(EvictedRightAfterWrite(tmp_path / "n1"))
    try:
        tokens = prompt(8, 3)
        keys = keys_of(n.node, tokens)
        n.node.store(n.node.tracker(token_ids=tokens), kv_chunks(CFG, 3))
        assert n.placements(keys, "l2") == set()  # no store event for bytes already gone
        assert n.placements(keys, "l1") == set(keys)
        assert [p for p in n.node.inventory() if p.tier == "l2"] == []
    finally:
        n.close()


def test_an_unreadable_file_is_dropped_reported_and_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the filesystem refuses to read (EIO) is a miss, is no longer held (counted,
    reported as a delete) and the next put of its key writes it again; a read failing for a
    reason that says nothing of the file (EMFILE) is a miss that keeps it."""
    import errno

    lost: list[tuple[ObjectKey, str]] = []
    l2 = FsL2(tmp_path)
    l2.attach(lambda c: True, lambda k, cause: lost.append((k, cause)))
    l2.put(chunk(1))
    l2.put(chunk(2))
    errors = {l2.path_for(key(1)): errno.EMFILE, l2.path_for(key(2)): errno.EIO}
    readable_again = failing_reads(monkeypatch, errors)
    assert l2.get(key(1)) is None and l2.get(key(2)) is None
    assert lost == [(key(2), "unreadable")]
    held = l2.keys()
    assert l2.contains(key(1)) and key(1) in held  # kept: the next read may work
    assert not l2.contains(key(2)) and key(2) not in held
    readable_again()
    l2.put(chunk(2))  # written again (a held file would be skipped)
    got = l2.get(key(2))
    assert got is not None and np.array_equal(got.kv, chunk(2).kv)
    assert l2.get(key(1)) is not None


def test_a_node_reports_an_unreadable_l2_file_as_a_delete_and_stores_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    n = InProcessNode(FsL2(tmp_path / "n1"))
    try:
        tokens, keys, l2 = in_l2_only(n, 5)
        readable_again = failing_reads(monkeypatch, {l2.path_for(keys[0]): errno.EIO})
        assert n.node.retrieve(n.node.tracker(token_ids=tokens)).hit_tokens == 0
        readable_again()
        assert n.node.counters["l2_unreadable"] == 1
        assert n.placements(keys, "l2") == {keys[1]}
        n.node.store(n.node.tracker(token_ids=tokens), kv_chunks(CFG, 2))
        assert n.placements(keys, "l2") == set(keys)
        assert n.node.retrieve(n.node.tracker(token_ids=tokens)).hit_tokens == 2 * C
    finally:
        n.close()
