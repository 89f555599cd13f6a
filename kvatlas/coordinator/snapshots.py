"""The coordinator's snapshots (``docs/coordinator.md``): restored at start-up, written every
``--snapshot-interval`` and at shutdown, with their named sections beside the directory (cache
control's, the KV-event engines') and the instance registry; with the Redis transport each one
records what it covers in the stream retention (:mod:`kvatlas.coordinator.retention`), which
then trims what no replica needs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kvatlas.coordinator.cache_control import SECTION, CacheControl, encode_state, restore_section
from kvatlas.coordinator.cache_control.journal import Journal
from kvatlas.coordinator.cache_control.snapshot import seed_with
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.kv_events.links import KvEventsLinks
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.retention import StreamRetention
from kvatlas.coordinator.views import Readiness
from kvatlas.directory import (
    KeyDirectory,
    SnapshotError,
    SnapshotInfo,
    load_snapshot,
    remove_stale_temps,
    save_snapshot,
)
from kvatlas.errors import InvalidInput, Unavailable

log = logging.getLogger(__name__)
KEY_SCHEME: Final = "key_scheme"
"""The snapshot section naming the ``--hash-scheme`` its keys were made with (a restore under
another one is refused: its keys are out of every lookup's reach)."""


class Snapshots:
    """One service's snapshots and the stream retention they record (see the module
    docstring). ``position`` reads the stream position a snapshot covers, ``state`` the
    service's readiness."""

    def __init__(
        self,
        config: CoordinatorConfig,
        directory: KeyDirectory,
        instances: InstanceRegistry,
        cache_control: CacheControl,
        kv_events: KvEventsLinks,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float],
        position: Callable[[], str | None],
        state: Callable[[], Readiness],
    ) -> None:
        self.config = config
        self.directory = directory
        self.instances = instances
        self.lost = False
        """A snapshot was there but could not be restored: the service starts empty, having
        lost what it knew (it resyncs before it serves)."""
        self.cache_control = cache_control
        self.kv_events = kv_events
        self.metrics = metrics
        self._clock = clock
        self._position = position
        self._state = state
        self.last: SnapshotInfo | None = None
        self.last_at: float | None = None  # when ``last`` was written (service clock)
        self.after: Callable[[SnapshotInfo], object] | None = None
        """Called with each snapshot written (the CLI's process: ``runtime.GrowthFreeze``)."""
        self.retention: StreamRetention | None = None  # set by the service (redis transport)
        self._lock = threading.Lock()
        self._cache_control_section: bytes | None = None  # the last one written
        self.journal = (
            Journal(
                config.snapshot_path, lambda reason: metrics.journal_failures.labels(reason).inc()
            )
            if config.snapshot_path is not None and cache_control.store is None
            else None
        )
        """Cache control's changes between snapshots (the HTTP transport: with Redis, the
        state is Redis's)."""

    def restore(self) -> SnapshotInfo | None:
        """Load the snapshot, if there is one, into the directory, cache control, the KV-event
        links and the instance registry, then replay cache control's journal from the
        generation the snapshot names; ``None``: no snapshot restored (a snapshot that cannot
        be read is logged, counted, moved aside — the next snapshot must not overwrite it: a
        newer release's, for one — and the service starts from the journal alone)."""
        info, journal_generation = self._load()
        journal = self.journal
        if journal is not None:
            generations = journal.generations()
            if info is None and generations and generations[0] > 1:
                journal.failed("orphaned")
                log.warning(
                    "cache-control journal beside %s starts at generation %d without its "
                    "snapshot: the pins, quotas and commands before it are not restored",
                    self.config.snapshot_path, generations[0],
                )  # fmt: skip
            replayed = journal.replay(self.cache_control, journal_generation)
            if replayed.records:
                log.info("replayed %d cache-control changes from the journal beside %s",
                         replayed.records, self.config.snapshot_path)  # fmt: skip
            journal.attach(self.cache_control, journal_generation)
        return info

    def _load(self) -> tuple[SnapshotInfo | None, int]:
        """The snapshot restored, and the journal generation its cache control names."""
        path = self.config.snapshot_path
        if path is None:
            return None, 0
        files, size = remove_stale_temps(path)
        if files:
            log.info("removed %d snapshot temp file(s) of %d bytes beside %s, left by a process "
                     "killed while writing", files, size, path)  # fmt: skip
        if not Path(path).exists():
            return None, 0
        try:
            info = load_snapshot(self.directory, path)
        except (SnapshotError, OSError) as exc:
            self.lost = True
            self.metrics.snapshot_failures.inc()
            log.error("snapshot %s could not be restored (%s); %s; starting empty",
                      path, exc, _set_aside(Path(path)))  # fmt: skip
            return None, 0
        written = (info.sections or {}).get(KEY_SCHEME)
        if written is not None and written.decode(errors="replace") != self.config.hash_scheme:
            raise InvalidInput(
                f"snapshot {path} holds keys of --hash-scheme {written.decode(errors='replace')}, "
                f"not {self.config.hash_scheme}: start with that scheme, or move the snapshot "
                "away to start empty"
            )
        journal_generation = restore_section(self.cache_control, info.sections, path)
        if info.sections is not None and SECTION in info.sections:
            # what a snapshot taken while the shared store's Redis is away carries on with
            self._cache_control_section = info.sections[SECTION]
        self.kv_events.restore(
            info.sections, lambda e: self.directory.gap_state(e) is not None, path
        )
        if info.instances is not None:
            self.instances.restore(info.instances)
        rate = info.keys / info.seconds if info.seconds else float("inf")
        log.info(
            "restored %d keys / %d chunks from %s in %.3f s (%.0f keys/s), stream position %s",
            info.keys, info.chunks, path, info.seconds, rate, info.stream_position,
        )  # fmt: skip
        return info, journal_generation

    def take(self, last: bool = False) -> SnapshotInfo | None:
        """Write a snapshot; the recorded stream position is read *before* the snapshot starts,
        so a restore may replay a few batches already in it, which the gate drops as
        duplicates (never the other way round: nothing applied is lost). Cache control's
        journal starts a new generation first, and the older ones go once the snapshot is
        written (:mod:`~kvatlas.coordinator.cache_control.journal`); ``last``: the service
        stops, the journal is closed after it."""
        path = self.config.snapshot_path
        if path is None:
            return None
        with self._lock:
            position = self._position()
            try:
                # -1: written without a journal (Redis): a restore replays none of the files
                generation = self.journal.rotate() if self.journal is not None else -1
                info = save_snapshot(
                    self.directory, path, stream_position=position,
                    instances=self.instances.rows(),
                    sections=self._sections(generation),
                )  # fmt: skip
            except Exception as exc:  # a disk's error, or a bug: the next one is taken
                self.metrics.snapshot_failures.inc()
                log.error(
                    "snapshot to %s failed: %s", path, exc, exc_info=not isinstance(exc, OSError)
                )
                return None
            finally:
                if last and self.journal is not None:
                    self.journal.close()
            if self.journal is not None:
                self._forget_before(self.journal, generation)
        self.last, self.last_at = info, self._clock()
        self._retain(position)
        if self.after is not None:
            self.after(info)
        self.metrics.snapshots.inc()
        self.metrics.snapshot_duration.set(info.seconds)
        self.metrics.snapshot_pause.set(info.max_pause_s)
        log.info(
            "snapshot: %d keys in %.3f s (longest pause %.2f ms)",
            info.keys, info.seconds, info.max_pause_s * 1e3,
        )  # fmt: skip
        return info

    def run(self, stop: threading.Event) -> None:
        """Take a snapshot every ``--snapshot-interval`` until ``stop`` is set; without
        ``--snapshot-path``, with cache control in Redis, keep a copy of it in memory instead
        (:meth:`keep_copy`); with Redis, the first copy at once."""
        if self.cache_control.store is not None:
            self.keep_copy()  # (with snapshots too: the first is an interval away)
        step = self.take if self.config.snapshot_path is not None else self.keep_copy
        while not stop.wait(self.config.snapshot_interval):
            step()

    def keep_copy(self) -> None:
        """Read cache control's shared state from Redis into this replica's copy, kept in
        memory only: what a Redis that lost the state is seeded with again. A replica without
        ``--snapshot-path`` held none, so a fleet of them lost every pin, quota and command
        to a FLUSHALL."""
        with self._lock:
            self._copy_cache_control(-1)

    def record_covered(self, fallback: str | None) -> None:
        """Record again what the last snapshot covers (else ``fallback``): Redis lost events,
        and the retention registry with them."""
        retention = self.retention
        if retention is not None:
            covered = self.last.stream_position if self.last else None
            self._record(retention, covered or fallback)

    def _sections(self, journal_generation: int) -> dict[str, bytes]:
        """The snapshot's named sections: the KV-event engines' and cache control's (with the
        Redis transport a copy of Redis's, the last one read when Redis is away;
        ``journal_generation``: the generation of cache control's journal replayed after it)."""
        self._copy_cache_control(journal_generation)
        section = self._cache_control_section
        sections = {
            KEY_SCHEME: self.config.hash_scheme.encode(),
            **self.kv_events.snapshot_sections(),
        }
        return sections if section is None else {SECTION: section, **sections}

    def _copy_cache_control(self, journal_generation: int) -> None:
        """Read cache control for the snapshot. With the Redis transport the copy is Redis's,
        and what a Redis that lost the state is seeded with again (:func:`seed_with`); one
        read while Redis is away, or from a Redis that lost the state during the read or
        before it (``meta.seeded`` gone, or another seeding's by the end of the read: what was
        read may mix two states), keeps the last copy: the empty state must not replace it,
        nor seed Redis."""
        control, store = self.cache_control, self.cache_control.store
        try:
            before = None if store is None else store.seeding()
            section = encode_state(control, journal_generation)
            held = store is None or (before is not None and store.seeding() == before)
        except Unavailable as exc:
            log.warning("cache control not copied from Redis (%s); last copy kept", exc)
            return
        if held:
            self._cache_control_section = section
            seed_with(control, section)
        elif self._cache_control_section is not None:
            log.warning("cache control: Redis holds no state (it lost its data?); "
                        "the last copy kept, to seed it again")  # fmt: skip

    def _forget_before(self, journal: Journal, generation: int) -> None:
        """The journal's files the snapshot just written holds, removed; a file that cannot
        be is left (logged; the next snapshot removes it), never a reason to stop snapshots."""
        try:
            journal.forget_before(generation)
        except OSError as exc:
            log.warning("cache-control journal: older generations not removed (%s)", exc)

    def _retain(self, position: str | None) -> None:
        """Record what this replica's snapshot covers, and trim what no replica needs."""
        retention = self.retention
        if retention is None or self._state() in (
            Readiness.WAITING_FOR_REDIS,
            Readiness.GROUP_HELD,
        ):
            return  # (redis) not (yet) this group's consumer: a live twin's position is not ours
        if self._record(retention, position):
            try:
                self.metrics.stream_trims.inc(retention.trim())
            except Unavailable as exc:  # Redis down: the next snapshot trims
                self.metrics.stream_errors.labels("retention").inc()
                log.warning("stream trim skipped: %s", exc)

    def _record(self, retention: StreamRetention, position: str | None) -> bool:
        """Record what this replica's snapshot covers; False if Redis did not take it."""
        if position is None:
            return False
        try:
            retention.record(position)
        except Unavailable as exc:  # Redis down: the next snapshot records
            self.metrics.stream_errors.labels("retention").inc()
            log.warning("stream retention skipped: %s", exc)
            return False
        return True


__all__ = ["Snapshots"]


def _set_aside(path: Path) -> str:
    """Move an unreadable snapshot to ``<name>.unreadable-<UTC time>`` beside it; what
    became of it, for the log."""
    if path.is_dir():  # refused at start (config); one made since is not ours to move
        return "it is a directory, left where it is"
    aside = path.with_name(
        f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    )
    try:
        os.replace(path, aside)
    except OSError as exc:
        return f"it could not be kept aside ({exc}): the next snapshot replaces it"
    return f"kept as {aside}"
