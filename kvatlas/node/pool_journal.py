"""A node's journal of the shared-pool changes whose events may not have left it yet
(docs/node.md, "Shared pools").

A shared pool is no node's own, so no digest exchange covers it: a node killed between writing
or removing a pool file and its event leaving the sink left every replica without that change
for good (``kvatlas soak``, seed 2: a file written at the instant of a ``kill -9`` was never
announced). So before each change the node appends the chunk's key to
``<pool>/.journal/<instance id>.log`` (one JSON line; no fsync: it is there for a process that
dies, as the event it stands for is; on a Redis pool, a Redis list beside the values), and once the events of the changes journaled so far were
delivered, :meth:`PoolJournal.cut` drops their lines. A node that starts on the pool with the
same instance id announces each key its previous run left journaled as the pool holds it now
(:meth:`PoolJournal.left_over`): a ``store`` for a file that is there, a ``delete`` for one
that is not. A duplicate is harmless (a store of a placement the directory holds, a delete of
one it does not).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from kvatlas.keys import ObjectKey
from kvatlas.node.l2 import FsL2, RedisL2

log = logging.getLogger(__name__)

JOURNAL_DIR = ".journal"


class JournalLines(Protocol):
    """Where a journal's lines are kept: :class:`FileLines` (an fs pool), :class:`RedisLines`
    (a Redis pool). ``name`` names them in log lines; ``errors``: what a failed call raises."""

    name: str
    errors: tuple[type[Exception], ...]

    def stored(self) -> bytes: ...

    def append(self, line: bytes) -> None: ...

    def rewrite(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class FileLines:
    """``<pool>/.journal/<instance id>.log``, held open for appends."""

    errors: tuple[type[Exception], ...] = (OSError,)

    def __init__(self, root: Path, instance_id: str) -> None:
        self.path = Path(root) / JOURNAL_DIR / f"{instance_id}.log"
        self.name = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open, closed by close()

    def stored(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    def append(self, line: bytes) -> None:
        if not self._file.closed:  # (a write racing the node's shutdown goes unjournaled)
            self._file.write(line)
            self._file.flush()

    def rewrite(self, data: bytes) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        self._file.close()
        self._file = open(self.path, "ab")  # noqa: SIM115

    def close(self) -> None:
        self._file.close()


class RedisLines:
    """A Redis list beside a Redis pool's values (``<prefix>journal:<instance id>``; a value's
    name is a 64-hex digest, never that)."""

    def __init__(self, l2: RedisL2, instance_id: str) -> None:
        self._redis = l2.client
        self.name = f"{l2.prefix}journal:{instance_id}"
        self.errors: tuple[type[Exception], ...] = (OSError, *l2.errors)
        self._closed = False

    def stored(self) -> bytes:
        return b"".join(self._redis.lrange(self.name, 0, -1))

    def append(self, line: bytes) -> None:
        if not self._closed:
            self._redis.rpush(self.name, line)

    def rewrite(self, data: bytes) -> None:
        lines = data.splitlines(keepends=True)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.name)
        if lines:
            pipe.rpush(self.name, *lines)
        pipe.execute()

    def close(self) -> None:
        self._closed = True


class PoolJournal:
    """The journal of one node, its lines kept in ``lines``."""

    def __init__(self, lines: JournalLines) -> None:
        self.lines = lines
        self.errors = lines.errors
        self._lock = threading.Lock()
        self._lines: list[tuple[int, ObjectKey, bytes]] = []  # not cut yet, in order
        self._open: set[int] = set()  # numbers whose event is not recorded yet
        self._next = 0
        self.failures = 0  # appends that failed (a full disk): those changes went unjournaled
        # the previous run's lines, kept (open) until :meth:`replayed`, then until a cut
        self._left_over = {key: self._keep(key, line) for key, line in self._read().items()}
        self._open.update(self._left_over.values())

    def _read(self) -> dict[ObjectKey, bytes]:
        """The keys of the previous run's lines (the last line of a key wins; a torn or
        foreign line is skipped)."""
        found: dict[ObjectKey, bytes] = {}
        for line in self.lines.stored().splitlines():
            try:
                key = ObjectKey.from_wire(json.loads(line)["key"])
            except (ValueError, KeyError, TypeError):
                continue
            found[key] = line + b"\n"
        return found

    def _keep(self, key: ObjectKey, line: bytes) -> int:
        number = self._next
        self._next += 1
        self._lines.append((number, key, line))
        return number

    def left_over(self) -> list[ObjectKey]:
        """The keys the previous run journaled and may not have announced."""
        return list(self._left_over)

    def replayed(self) -> None:
        """The left-over keys' events are recorded: their lines go with the next cut."""
        with self._lock:
            self._open.difference_update(self._left_over.values())
            self._left_over = {}

    def begin(self, key: ObjectKey) -> int:
        """Journal a change of ``key`` about to be made; :meth:`end` once its event is recorded
        (or the change failed)."""
        line = json.dumps({"key": key.to_wire()}, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            number = self._keep(key, line)
            self._open.add(number)
            try:
                self.lines.append(line)
            except self.errors as exc:  # the change goes on, unjournaled: counted, said once
                self.failures += 1
                if self.failures == 1:
                    log.warning("pool journal %s not written: %s", self.lines.name, exc)
        return number

    def end(self, number: int) -> None:
        with self._lock:
            self._open.discard(number)

    @contextmanager
    def changing(self, key: ObjectKey) -> Iterator[None]:
        """:meth:`begin` and :meth:`end` around a change of ``key`` and its event."""
        number = self.begin(key)
        try:
            yield
        finally:
            self.end(number)

    def keys(self) -> list[ObjectKey]:
        """The keys of the lines not cut yet (each once)."""
        with self._lock:
            return list(dict.fromkeys(key for _, key, _ in self._lines))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lines)

    def cut(self, delivered: Callable[[], bool]) -> int:
        """Drop the lines whose events are recorded, if ``delivered()`` (called after taking the
        mark: it flushes the events recorded so far) says they all left; returns how many."""
        with self._lock:
            upto = min(self._open) if self._open else self._next
        if not delivered():
            return 0
        with self._lock:
            kept = [row for row in self._lines if row[0] >= upto]
            dropped = len(self._lines) - len(kept)
            if not dropped:
                return 0
            self.lines.rewrite(b"".join(line for _, _, line in kept))
            self._lines = kept
        return dropped

    def close(self) -> None:
        with self._lock:
            self.lines.close()


ANNOUNCE_MAX_S = 300.0
"""The longest wait between two announcements of the journaled keys while each one is lost
again (:class:`JournalCutter`)."""


class JournalCutter:
    """Cuts ``journal`` every ``interval`` seconds once the events recorded so far left:
    ``flush(timeout)`` flushes them and says whether they were delivered. When the sink lost
    batches meanwhile (``losses()`` grew: dropped, or refused), the journaled keys are
    announced again (``announce(keys)``) instead, and cut once those left.

    A refusal that persists (the coordinator refuses every batch of the node: its clock runs
    too far ahead, ...) refuses each announcement too, which the next round sees as a loss:
    announced every round, that was every key's pool file read and sent again each second,
    for nothing. So while announcements keep being lost the next waits twice as long as the
    one before (2 s, 4 s, ... up to :data:`ANNOUNCE_MAX_S`), and a round that delivered
    everything without a loss makes the next one go at once again. The lines are kept
    meanwhile, not cut: the refusal may end (the clock is fixed, the coordinator's
    ``--max-clock-skew-s`` raised), and then the next announcement delivers them."""

    def __init__(
        self,
        journal: PoolJournal,
        *,
        flush: Callable[[float], bool],
        losses: Callable[[], int],
        announce: Callable[[Sequence[ObjectKey]], object],
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.journal = journal
        self._flush = flush
        self._losses = losses
        self._announce = announce
        self._seen = losses()
        self.interval = interval
        self._clock = clock
        self._owed = False  # a loss was seen: announce once the wait below is over
        self._wait = 0.0  # after the last announcement (0: none was lost since a delivery)
        self._next_at = -math.inf
        self.announcements = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> int:
        """One round; returns the lines cut."""
        if not len(self.journal):
            return 0
        losses = self._losses()
        if losses != self._seen:  # some journaled change's event may be among them
            self._seen = losses
            self._owed = True
        if self._owed:
            now = self._clock()
            if now < self._next_at:
                return 0
            self._owed = False
            self._wait = min(ANNOUNCE_MAX_S, max(2 * self.interval, 2 * self._wait))
            self._next_at = now + self._wait
            self.announcements += 1
            log.warning(
                "the event sink lost batches: announcing the journaled pool keys again (the "
                "next announcement, should this one be lost too, in %.0f s)", self._wait,
            )  # fmt: skip
            self._announce(self.journal.keys())
            return 0
        delivered = False

        def all_delivered() -> bool:
            nonlocal delivered
            delivered = self._flush(5.0) and self._losses() == losses
            return delivered

        cut = self.journal.cut(all_delivered)
        if delivered:  # nothing lost since the last announcement: the next goes at once
            self._wait, self._next_at = 0.0, -math.inf
        return cut

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvatlas-pool-journal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except self.journal.errors as exc:  # the pool's disk: try again next round
                log.warning("pool journal not cut: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.journal.close()


class PoolWrites(Protocol):
    """What :func:`journal_pool_changes` needs of the node's tier writes."""

    journal: PoolJournal | None

    def announce_pool(self, keys: Sequence[ObjectKey]) -> int: ...


def journal_pool_changes(
    l2: object,
    sink: object,
    instance_id: str,
    flush_events: Callable[[], object],
    writes: PoolWrites,
) -> JournalCutter | None:
    """For a shared pool (``l2``: fs or Redis) and an event sink that says what it delivered: journal
    the node's pool changes (``writes.journal``), announce what the previous run left
    journaled, and cut the journal as the events leave. ``None`` otherwise."""
    flush, stats = getattr(sink, "flush", None), getattr(sink, "stats", None)
    if not (isinstance(l2, FsL2 | RedisL2) and l2.shared and callable(flush) and callable(stats)):
        return None
    try:
        lines = (
            FileLines(l2.root, instance_id) if isinstance(l2, FsL2) else RedisLines(l2, instance_id)
        )
        journal = PoolJournal(lines)  # (reads what the previous run left)
    except (OSError, *getattr(l2, "errors", ())) as exc:  # e.g. a pool mounted read-only
        # here, a Redis that does not answer: the node serves without it
        log.warning("shared pool changes not journaled (a kill may lose their events): %s", exc)
        return None
    writes.journal = journal
    if left := journal.left_over():
        log.info("announcing %d pool changes the previous run journaled", len(left))
        writes.announce_pool(left)
    journal.replayed()

    def losses() -> int:
        s = stats()
        return int(s.dropped_batches + s.quarantined_batches)

    def delivered(timeout: float) -> bool:
        flush_events()
        return bool(flush(timeout=timeout))

    cutter = JournalCutter(journal, flush=delivered, losses=losses, announce=writes.announce_pool)
    cutter.start()
    return cutter


__all__ = ["JOURNAL_DIR", "JournalCutter", "PoolJournal", "journal_pool_changes"]
