"""A Redis that lost the shared cache-control state while the replicas run is seeded again
(docs/cache-control.md, "Restart and snapshots: Redis wins"), on a real redis-server: by one
replica only, from its last copy of the state, and a snapshot taken between the loss and the
seed keeps that copy (it read the empty state). The replicas' test
(``test_cache_control_replicas.py::test_a_redis_that_loses_the_state_while_the_replicas_run_is_seeded_again``)
runs the same through two coordinators."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import redis

from kvatlas.coordinator.cache_control import SECTION, CacheControl, restore_state
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.directory import KeyDirectory
from kvatlas.directory.snapshot import load_snapshot
from tests.conftest import RedisServer
from tests.coordinator.test_cache_control_model import fields

_streams = itertools.count()


def lose(redis_server: RedisServer, stream: str) -> None:
    """Redis loses the fleet's data (as FLUSHALL would, for this stream's keys only)."""
    admin = redis.Redis.from_url(redis_server.url)
    try:
        admin.delete(*admin.keys(f"{stream}:*"))
    finally:
        admin.close()


def redis_replica(
    redis_server: RedisServer, tmp_path: Path
) -> tuple[str, CoordinatorService, SharedStore]:
    """A coordinator (not started) on its own stream, its cache control in Redis, and its
    store."""
    stream = f"kvatlas:reseed-test-{next(_streams)}"
    config = CoordinatorConfig(
        chunk_size=16, event_transport="redis", redis_url=redis_server.url, event_stream=stream,
        replica_id="a", snapshot_path=tmp_path / "a.snap",
    )  # fmt: skip
    service = CoordinatorService(config)
    assert service.cache_control.store is not None
    return stream, service, service.cache_control.store


def snapshot_copy(path: Path | None) -> CacheControl:
    """The cache control a snapshot file's section holds."""
    assert path is not None
    sections = load_snapshot(KeyDirectory(16), path).sections
    assert sections is not None and SECTION in sections
    copy = CacheControl(16, is_instance=lambda _i: True, usage_by_salt=dict)
    restore_state(copy, sections[SECTION])
    return copy


def test_one_replica_seeds_a_redis_that_lost_the_state_again(redis_server: RedisServer) -> None:
    """Both replicas hold a copy and notice the loss; the first to mark Redis seeds it, the
    other finds it seeded. A replica without a copy marks nothing (a replica with one seeds)."""
    stream = f"kvatlas:reseed-test-{next(_streams)}"
    stores = [SharedStore.connect(redis_server.url, stream, o) for o in ("a", "b", "c")]
    seeds: list[str] = []
    try:
        for store in stores[:2]:
            store.seed = lambda owner=store.owner: seeds.append(owner)
        assert [s.check() for s in stores] == [False] * 3  # the start: a seeds, not a re-seed
        assert seeds == ["a"]
        assert [s.check() for s in stores] == [False] * 3  # Redis holds the state
        lose(redis_server, stream)
        assert stores[2].check() is False  # no copy: Redis still holds nothing
        assert not stores[0].holds_state()
        assert [s.check() for s in reversed(stores)] == [False, True, False]  # b first
        assert seeds == ["a", "b"]
        assert [s.reseeds for s in stores] == [0, 1, 0]
        assert [s.check() for s in stores] == [False] * 3  # seeded once
        assert seeds == ["a", "b"]
    finally:
        for store in stores:
            store.client.close()


def test_a_snapshot_between_the_loss_and_the_seed_keeps_the_last_copy(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The key edge: a snapshot reads Redis after it lost the state and before a replica seeded
    it again. The old code copied the empty state into the snapshot and made it the copy Redis
    would be seeded from: the pins and the quota were gone for good."""
    stream, service, store = redis_replica(redis_server, tmp_path)
    control, config = service.cache_control, service.config
    try:
        assert control.pin(fields(48)).affected == 3
        control.quotas.set("tenant", 2.0)
        assert service.take_snapshot() is not None  # the copy: read from Redis
        lose(redis_server, stream)
        assert control.pins.rows() == []  # the loss, seen by every read
        assert service.take_snapshot() is not None  # after the loss, before the seed
        copy = snapshot_copy(config.snapshot_path)
        assert len(copy.pins.rows()) == 3  # the copy, not the empty state
        assert copy.quotas.limits() == {"tenant": 2.0}
        assert store.check() is True  # seeded again, from the copy
        assert [n for _k, n in control.pins.rows()] == [1, 1, 1]
        assert control.quotas.limits() == {"tenant": 2.0}
        assert store.reseeds == 1
    finally:
        store.client.close()


def test_a_seeded_command_is_read_afresh_by_every_replica(redis_server: RedisServer) -> None:
    """Replica b keeps the unfinished commands it read by their revision. A seed writes each
    command anew; had its revision restarted at 1, b would go on with its own copy of revision
    1 — here one without the failed attempt the seed's copy records — for as long as nothing
    changes the command (the delivery loop skips a due copy whose command changed since)."""
    from kvatlas.coordinator.cache_control.commands import CommandLog
    from kvatlas.coordinator.cache_control.service import wire_key
    from kvatlas.coordinator.cache_control.shared_commands import SharedCommandLog
    from kvatlas.keys import ObjectKey, pack_kv_rank

    stream = f"kvatlas:reseed-test-{next(_streams)}"
    stores = [SharedStore.connect(redis_server.url, stream, o) for o in ("a", "b")]
    a, b = (SharedCommandLog(s) for s in stores)
    try:
        key = wire_key(ObjectKey(bytes(32), "m", pack_kv_rank(1, 0, 1, 0), 0, ""))
        command = a.new("delete", ["n1"], [key])
        assert [c.attempts for c in b.unfinished()] == [0]  # b keeps revision 1
        a.delivery_failed(command.command_id, "n1 is down")  # revision 2: a's copy
        copy = a.to_snapshot()
        lose(redis_server, stream)
        stores[0].seed = lambda: a.seed(copy)  # (seeded as a watch seeds: Redis marked first)
        assert stores[0].check() is True
        assert [c.attempts for c in b.unfinished()] == [1]
        assert b.get(command.command_id) == CommandLog.from_snapshot(copy).get(command.command_id)
    finally:
        for store in stores:
            store.client.close()


def test_a_seed_that_fails_leaves_the_watch_going(redis_server: RedisServer) -> None:
    """A copy that does not seed (here a ValueError, as a section of another version raises)
    is logged and tried again: the watch thread used to end on anything but Unavailable, and
    with it every later re-seed of the process."""
    import threading

    from tests.conftest import wait_for

    stream = f"kvatlas:reseed-test-{next(_streams)}"
    store = SharedStore.connect(redis_server.url, stream, "a")
    tries: list[int] = []

    def seed() -> None:
        tries.append(len(tries))
        if len(tries) == 1:
            raise ValueError("command snapshot version 9 is not 1")

    store.seed = seed
    stop = threading.Event()
    watch = threading.Thread(target=store.watch, args=(stop, 0.05), daemon=True)
    watch.start()
    try:
        assert wait_for(lambda: len(tries) >= 2 and store.holds_state(), timeout=30)
        assert watch.is_alive()
    finally:
        stop.set()
        watch.join(timeout=10)
        store.client.close()


def test_a_snapshot_whose_read_spans_a_loss_and_a_seed_keeps_the_last_copy(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis loses the state and is seeded again while a snapshot reads it: what the read got
    may mix the two (here: nothing at all), though Redis holds state before and after. Which
    seeding Redis holds is read before and after the copy, and the copy kept only if it is
    the same one (the old code asked only afterwards: the empty read became the copy)."""
    from kvatlas.coordinator import snapshots

    stream, service, store = redis_replica(redis_server, tmp_path)
    control, config = service.cache_control, service.config
    try:
        assert control.pin(fields(48)).affected == 3
        assert service.take_snapshot() is not None  # the copy: 3 pins
        real = snapshots.encode_state

        def read_across_a_loss(*args: Any) -> bytes:
            lose(redis_server, stream)
            data = real(*args)  # reads the empty state
            assert store.check() is True  # seeded again, before the read is checked
            return data

        monkeypatch.setattr(snapshots, "encode_state", read_across_a_loss)
        assert service.take_snapshot() is not None
        copy = snapshot_copy(config.snapshot_path)
        assert len(copy.pins.rows()) == 3
    finally:
        store.client.close()


def test_a_replica_without_a_snapshot_path_keeps_a_copy_to_seed_with(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A replica without ``--snapshot-path`` held no copy of the shared state, so a fleet of
    them lost every pin and quota to a FLUSHALL (the old code: no seed, pins ``[]``). Its
    snapshot loop keeps a copy in memory instead, every ``--snapshot-interval`` (the first at
    once), which seeds Redis again."""
    import threading

    from tests.conftest import wait_for

    stream, service, store = redis_replica(redis_server, tmp_path)
    config = service.snapshots.config = dataclasses.replace(
        service.config, snapshot_path=None, snapshot_interval=0.05
    )
    control, stop = service.cache_control, threading.Event()
    loop = threading.Thread(target=service.snapshots.run, args=(stop,), daemon=True)
    try:
        assert control.pin(fields(48)).affected == 3
        control.quotas.set("tenant", 2.0)
        loop.start()
        assert wait_for(lambda: store.seed is not None, timeout=30)
        lose(redis_server, stream)
        assert control.pins.rows() == []
        assert store.check() is True  # seeded again, from the copy in memory
        assert [n for _k, n in control.pins.rows()] == [1, 1, 1]
        assert control.quotas.limits() == {"tenant": 2.0}
        assert config.snapshot_path is None and not list(tmp_path.iterdir())  # no file
    finally:
        stop.set()
        loop.join(timeout=10)
        store.client.close()


def test_a_change_between_the_loss_and_the_seed_is_not_written_over(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis loses the state; before any replica's watch notices, replica b pins keys its copy
    holds and sets a quota (b has made a change before, so it does not check Redis first).
    The old code wrote both into the empty Redis, then a's watch
    seeded its copy over them: the pins counted once, not twice, and the quota was the old
    one. A change's script now refuses a Redis without the state, and the replica seeds it
    first (b, from its own copy), then makes the change."""
    stream, a, _store = redis_replica(redis_server, tmp_path)
    config = dataclasses.replace(a.config, replica_id="b", snapshot_path=None)
    b = CoordinatorService(config)
    stores = [s for s in (a.cache_control.store, b.cache_control.store) if s is not None]
    try:
        assert a.cache_control.pin(fields(48)).affected == 3
        a.cache_control.quotas.set("tenant", 2.0)
        b.cache_control.quotas.set("other", 1.0)  # b has marked Redis: its next change is as any
        for service in (a, b):
            service.snapshots.keep_copy()
        lose(redis_server, stream)
        assert b.cache_control.pin(fields(48)).affected == 3
        b.cache_control.quotas.set("tenant", 3.0)
        assert [s.check() for s in stores] == [False, False]  # Redis holds the state
        assert [n for _k, n in a.cache_control.pins.rows()] == [2, 2, 2]
        assert a.cache_control.quotas.limits() == {"tenant": 3.0, "other": 1.0}
        assert [s.reseeds for s in stores] == [0, 1]
    finally:
        for store in stores:
            store.client.close()


def test_a_replica_without_a_copy_waits_for_one_with_a_copy_to_seed(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica b holds no copy (its first would come later). Its change after the loss is
    refused for a moment (503), so that a's copy seeds Redis: had b marked Redis, a's watch
    would have found it seeded and the fleet's pins and quota were gone. With no replica
    seeding within NO_COPY_WAIT_S, b marks Redis itself (a fleet with no copy anywhere)."""
    from kvatlas.coordinator.cache_control import shared_store
    from kvatlas.errors import Unavailable

    stream, a, _store = redis_replica(redis_server, tmp_path)
    b = CoordinatorService(dataclasses.replace(a.config, replica_id="b", snapshot_path=None))
    stores = [s for s in (a.cache_control.store, b.cache_control.store) if s is not None]
    try:
        assert a.cache_control.pin(fields(48)).affected == 3
        a.cache_control.quotas.set("tenant", 2.0)
        b.cache_control.quotas.set("other", 1.0)  # b has marked Redis, and holds no copy
        a.snapshots.keep_copy()
        lose(redis_server, stream)
        with pytest.raises(Unavailable, match="holds none"):
            b.cache_control.pin(fields(48))
        assert not stores[0].holds_state()  # b marked nothing
        assert stores[0].check() is True  # a's watch: seeded from its copy
        assert b.cache_control.pin(fields(48)).affected == 3
        assert [n for _k, n in a.cache_control.pins.rows()] == [2, 2, 2]
        assert a.cache_control.quotas.limits() == {"tenant": 2.0, "other": 1.0}
        lose(redis_server, stream)  # again, and no replica with a copy notices in time
        monkeypatch.setattr(shared_store, "NO_COPY_WAIT_S", 0.0)
        b.cache_control.quotas.set("other", 3.0)
        assert stores[1].holds_state() and a.cache_control.quotas.limits() == {"other": 3.0}
    finally:
        for store in stores:
            store.client.close()
