"""The shared pool's journal (node/pool_journal.py): a node killed between changing a pool file
and its event leaving the sink announces the change when it starts again (a store for a file
that is there, a delete for one that is not); lines go once their events were delivered; a
sink that lost batches makes the journaled keys go out again."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from kvatlas.client import EventSink, InProcessTransport
from kvatlas.directory import KeyDirectory
from kvatlas.events import EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.l2 import FsL2, L2Backend, RedisL2
from kvatlas.node.pool_journal import FileLines, JournalCutter, PoolJournal
from tests.conftest import RedisServer, wait_for
from tests.helpers import TINY, node_config

CS = 4
config = partial(node_config, model_name="m", **TINY, chunk_size=CS, instance_id="p1")


class Gate:
    """A transport into ``directory`` that can be shut: batches sent then are never
    delivered (the process is about to be killed)."""

    def __init__(self, directory: KeyDirectory) -> None:
        self.directory = directory
        self.open = True

    def consume(self, batch: EventBatch) -> None:
        if not self.open:
            raise ConnectionError("the node is being killed")
        self.directory.consume(batch)


def pool_node(
    pool: Path | str, directory: KeyDirectory, incarnation: int
) -> tuple[CacheNode, Gate]:
    """A node on the fs pool at ``pool``, or on the Redis pool of that ``redis://`` URL."""
    gate = Gate(directory)
    sink = EventSink("p1", InProcessTransport(gate.consume), incarnation=incarnation)
    l2: L2Backend
    if isinstance(pool, str):
        url, _, prefix = pool.partition("#")
        l2 = RedisL2(url, prefix=prefix)
    else:
        l2 = FsL2(pool, "fs-shared", shared=True)
    return CacheNode(config(), l2=l2, sink=sink), gate


def kill(node: CacheNode, gate: Gate) -> None:
    """What ``kill -9`` leaves: the pool's files and the journal; nothing more is delivered."""
    gate.open = False
    node.close()  # (the journal's thread: its file stays as it is)
    sink = node._sink
    assert isinstance(sink, EventSink)
    sink.close(timeout=0.2)


def in_pool(directory: KeyDirectory, keys: Sequence[ObjectKey]) -> list[bool]:
    return [
        any(p.tier == "l2" and p.shared for p in kp.placements) for kp in directory.lookup(keys)
    ]


def store(node: CacheNode, first: int, n: int) -> list[ObjectKey]:
    tracker = node.tracker(token_ids=list(range(first, first + n * CS)))
    kv = np.zeros(node.layout.shape, dtype=node.layout.numpy_dtype())
    assert node.store(tracker, [kv] * n) == n
    return [node.key(h, "") for h in tracker.chunk_hashes()]


@pytest.mark.parametrize("backend", ["fs", "redis"])
def test_a_pool_change_whose_event_died_with_the_node_is_announced_at_its_restart(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """Found by ``kvatlas soak`` (seed 2: a pool file written at the instant its node was
    killed stayed unknown to both replicas for good). A Redis L2 is a pool too: a value written
    at the instant of a ``kill -9`` of its node stayed unknown for good (found by a kill -9
    probe of real node processes on a Redis L2)."""
    pool: Path | str = tmp_path / "pool"
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        pool = f"{server.url}#test:{uuid.uuid4().hex}:"
    directory = KeyDirectory(CS)
    node, gate = pool_node(pool, directory, 1)
    kept = store(node, 100, 2)
    node.flush_events()
    assert node._sink.flush(10)  # type: ignore[union-attr]
    assert in_pool(directory, kept) == [True, True]
    assert node.pool_journal is not None
    assert wait_for(lambda: len(node.pool_journal.journal) == 0)  # type: ignore[union-attr]
    gate.open = False  # from here on nothing the node records leaves it
    written = store(node, 300, 2)
    assert node.writes.drop_l2(kept[0])  # a delete whose event dies with the node too
    kill(node, gate)
    assert in_pool(directory, written + kept) == [False, False, True, True]  # before
    restarted, gate = pool_node(pool, directory, 2)
    try:
        restarted.flush_events()
        assert restarted._sink.flush(10)  # type: ignore[union-attr]
        assert in_pool(directory, written + kept) == [True, True, False, True]
        assert restarted.counters["pool_changes_announced"] == 3
    finally:
        kill(restarted, gate)


def test_a_clean_restart_announces_nothing(tmp_path: Path) -> None:
    directory, pool = KeyDirectory(CS), tmp_path / "pool"
    node, gate = pool_node(pool, directory, 1)
    store(node, 100, 2)
    assert node.pool_journal is not None
    assert wait_for(lambda: len(node.pool_journal.journal) == 0)  # type: ignore[union-attr]
    assert node.pool_journal.journal.lines.stored() == b""
    kill(node, gate)
    restarted, gate = pool_node(pool, directory, 2)
    try:
        assert restarted.counters["pool_changes_announced"] == 0
    finally:
        kill(restarted, gate)


def key(n: int) -> ObjectKey:
    return ObjectKey(bytes([n]) * 32, "m", pack_kv_rank(1, 0, 1, 0))


def test_lines_go_only_once_their_events_left_and_none_still_open(tmp_path: Path) -> None:
    journal = PoolJournal(FileLines(tmp_path, "n"))
    done, still = journal.begin(key(1)), journal.begin(key(2))
    journal.end(done)
    assert journal.cut(lambda: False) == 0 and len(journal) == 2  # not delivered yet
    assert journal.cut(lambda: True) == 1  # the open one stays
    assert journal.keys() == [key(2)]
    journal.end(still)
    journal.close()
    again = PoolJournal(FileLines(tmp_path, "n"))  # what a restart finds
    assert again.left_over() == [key(2)]
    assert again.cut(lambda: True) == 0  # not announced yet: kept
    again.replayed()
    assert again.cut(lambda: True) == 1 and again.lines.stored() == b""
    again.close()


def test_a_torn_line_is_skipped(tmp_path: Path) -> None:
    lines = FileLines(tmp_path, "n")
    journal = PoolJournal(lines)
    journal.begin(key(1))
    journal.close()
    with open(lines.path, "ab") as f:
        f.write(b'{"key": {"chunk_hash": "0a')  # killed in the middle of a line
    assert PoolJournal(FileLines(tmp_path, "n")).left_over() == [key(1)]


def test_a_sink_that_lost_batches_announces_the_journaled_keys_again(tmp_path: Path) -> None:
    journal = PoolJournal(FileLines(tmp_path, "n"))
    journal.end(journal.begin(key(1)))
    lost, announced = [0], []
    cutter = JournalCutter(
        journal, flush=lambda _: True, losses=lambda: lost[0], announce=announced.append
    )
    lost[0] = 1  # a batch dropped (the outbox was full) or refused
    assert cutter.tick() == 0 and announced == [[key(1)]]
    assert cutter.tick() == 1 and len(journal) == 0  # then cut once those left
    journal.close()


def test_announcements_lost_again_back_off_and_go_at_once_after_a_delivery(
    tmp_path: Path,
) -> None:
    """A refusal that persists (every batch refused: a clock far ahead) loses each
    announcement too: the next waits 2 s, 4 s, ... (it was one a second, each reading every
    journaled key's pool file), the lines are kept, and once the refusal ends the next
    announcement delivers them, and a later loss is announced again at once."""
    journal = PoolJournal(FileLines(tmp_path, "n"))
    journal.end(journal.begin(key(1)))
    now, lost, announced = [0.0], [0], []
    cutter = JournalCutter(
        journal, flush=lambda _: True, losses=lambda: lost[0], announce=announced.append,
        clock=lambda: now[0],
    )  # fmt: skip
    at = []
    for second in range(20):  # a tick a second; each announcement refused (a loss)
        now[0] = float(second)
        lost[0] += 1
        before = len(announced)
        assert cutter.tick() == 0
        if len(announced) > before:
            at.append(second)
    assert at == [0, 2, 6, 14], at  # waits of 2, 4, 8 s (then 16, ... up to 300 s)
    assert len(journal) == 1  # kept: nothing delivered it yet
    now[0] = 30.0  # the refusal ended: the owed announcement goes, and is delivered
    assert cutter.tick() == 0 and len(announced) == 5
    assert cutter.tick() == 1 and len(journal) == 0
    journal.end(journal.begin(key(2)))
    lost[0] += 1  # a later loss (a full outbox): announced at the next tick, no wait
    assert cutter.tick() == 0 and announced[-1] == [key(2)]
    journal.close()


def test_a_pool_the_node_cannot_write_a_journal_in_is_served_without_one(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / ".journal").write_bytes(b"")  # a file where the directory goes: mkdir fails
    directory = KeyDirectory(CS)
    node, gate = pool_node(pool, directory, 1)
    try:
        assert node.pool_journal is None and node.writes.journal is None
        stored = store(node, 100, 1)
        node.flush_events()
        assert node._sink.flush(10)  # type: ignore[union-attr]
        assert in_pool(directory, stored) == [True]
    finally:
        kill(node, gate)


def test_a_journal_append_that_fails_does_not_fail_the_change(tmp_path: Path) -> None:
    class FullDisk:
        closed = False

        def write(self, _data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None: ...

        def close(self) -> None: ...

    lines = FileLines(tmp_path, "n")
    lines._file.close()
    lines._file = FullDisk()  # type: ignore[assignment]
    journal = PoolJournal(lines)
    journal.end(journal.begin(key(1)))  # no exception: the pool write goes on
    journal.end(journal.begin(key(2)))
    assert journal.failures == 2
