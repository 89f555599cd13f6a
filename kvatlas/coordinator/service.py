"""The coordinator's moving parts, independent of HTTP: directory, instances, auth, snapshots,
the Redis Streams consumer and the background threads that tie them together.

Readiness: ``restoring`` (loading the snapshot) → ``catching_up`` (Redis transport: replaying
the stream up to its end) → ``serving``. Lookups are answered in every state; ``/readyz``
tells a load balancer whether the answers are complete.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvatlas.coordinator.auth import TokenAuth
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.directory import DirectoryStats, KeyDirectory
from kvatlas.directory.gate import Outcome
from kvatlas.directory.key_directory import IngestCounts
from kvatlas.directory.snapshot import SnapshotError, SnapshotInfo, load_snapshot, save_snapshot
from kvatlas.directory.warm_up import warm_up_kernels
from kvatlas.events import EventBatch
from kvatlas.keys import MM_BYPASS_GUARD

log = logging.getLogger("kvatlas.coordinator")

RESTORING, CATCHING_UP, SERVING = "restoring", "catching_up", "serving"


class CoordinatorService:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.scheme = config.scheme
        scheme = self.scheme
        self.directory = KeyDirectory(
            config.chunk_size,
            enable_blend_lookup=config.enable_blend_lookup,
            blend_probe_stride=config.blend_probe_stride,
            hash_chunks=lambda tokens, _chunk_size: scheme.chunk_hashes(tokens),
        )
        self.auth = TokenAuth.from_file(config.auth_token_file) if config.auth_token_file else None
        self.instances = InstanceRegistry(config.instance_timeout, self._fence_expired)
        self.metrics = CoordinatorMetrics(self.metrics_state)
        self.state = RESTORING
        self.stream_position: str | None = None
        self.last_snapshot: SnapshotInfo | None = None
        self._lag: dict[str, float] = {}
        self._lag_lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consumer: Any = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        warm_up_kernels()
        self.restore()
        self._spawn("instance-sweeper", self._sweep_loop)
        if self.config.snapshot_path is not None:
            self._spawn("snapshotter", self._snapshot_loop)
        if self.config.event_transport == "redis":
            from kvatlas.coordinator.stream_consumer import StreamConsumer

            self.state = CATCHING_UP
            self._consumer = StreamConsumer(self)
            self._spawn("stream-consumer", self._consumer.run)
        else:
            self.state = SERVING

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()
        if self.config.snapshot_path is not None:
            self.take_snapshot()

    @property
    def stopping(self) -> threading.Event:
        return self._stop

    def _spawn(self, name: str, target: Any) -> None:
        thread = threading.Thread(target=target, name=f"kvatlas-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ ingestion

    def ingest(self, batches: Sequence[EventBatch]) -> IngestCounts:
        """Apply decoded batches through the gate (each atomically) and account for them."""
        applied = duplicates = stale = 0
        now = time.time()
        for batch in batches:
            outcome = self.directory.consume(batch)
            self.metrics.batches.labels(batch.instance_id, outcome.value).inc()
            if outcome is Outcome.APPLIED:
                applied += 1
                self.metrics.entries.inc(len(batch.entries))
                if batch.ts > 0:
                    with self._lag_lock:
                        self._lag[batch.instance_id] = max(0.0, now - batch.ts)
            elif outcome is Outcome.DUPLICATE:
                duplicates += 1
            else:
                stale += 1
        return IngestCounts(applied, duplicates, stale)

    def deregister(self, instance_id: str) -> int:
        self.instances.deregister(instance_id)
        with self._lag_lock:
            self._lag.pop(instance_id, None)
        return self.directory.deregister(instance_id)

    def _fence_expired(self, instance_id: str) -> None:
        dropped = self.directory.fence_instance(instance_id)
        self.metrics.instances_expired.inc()
        log.warning(
            "instance %s missed heartbeats: fenced (%d L1 placements dropped)", instance_id, dropped
        )

    def _sweep_loop(self) -> None:
        period = min(1.0, self.config.instance_timeout / 4)
        while not self._stop.wait(period):
            self.instances.expire()

    # ------------------------------------------------------------------ snapshots

    def restore(self) -> None:
        path = self.config.snapshot_path
        self.state = RESTORING
        if path is None or not Path(path).exists():
            return
        try:
            info = load_snapshot(self.directory, path)
        except (SnapshotError, OSError) as exc:
            log.error("snapshot %s could not be restored (%s); starting empty", path, exc)
            return
        self.stream_position = info.stream_position
        rate = info.keys / info.seconds if info.seconds else float("inf")
        log.info(
            "restored %d keys / %d chunks from %s in %.3f s (%.0f keys/s), stream position %s",
            info.keys, info.chunks, path, info.seconds, rate, info.stream_position,
        )  # fmt: skip

    def take_snapshot(self) -> SnapshotInfo | None:
        """Write a snapshot; the recorded stream position is read *before* the snapshot starts,
        so a restore may replay a few batches already in it, which the gate drops as
        duplicates (never the other way round: nothing applied is lost)."""
        path = self.config.snapshot_path
        if path is None:
            return None
        with self._snapshot_lock:
            position = self.stream_position
            try:
                info = save_snapshot(self.directory, path, stream_position=position)
            except OSError as exc:
                self.metrics.snapshot_failures.inc()
                log.error("snapshot to %s failed: %s", path, exc)
                return None
        self.last_snapshot = info
        self.metrics.snapshots.inc()
        self.metrics.snapshot_duration.set(info.seconds)
        self.metrics.snapshot_pause.set(info.max_pause_s)
        log.info(
            "snapshot: %d keys in %.3f s (longest pause %.2f ms)",
            info.keys, info.seconds, info.max_pause_s * 1e3,
        )  # fmt: skip
        return info

    def _snapshot_loop(self) -> None:
        while not self._stop.wait(self.config.snapshot_interval):
            self.take_snapshot()

    # ------------------------------------------------------------------ views

    def emitters_view(self) -> dict[str, dict[str, Any]]:
        with self._lag_lock:
            lag = dict(self._lag)
        out = {}
        for inst, cursor in self.directory.emitters().items():
            out[inst] = {
                "incarnation": cursor.incarnation,
                "last_seq": cursor.last_seq,
                "gaps": cursor.gaps,
                "missing_batches": cursor.missing_batches,
                "lag_s": lag.get(inst),
            }
        return out

    def instances_view(self) -> list[dict[str, Any]]:
        now, records = self.instances.snapshot()
        emitters = self.emitters_view()
        rows = []
        for record in records:
            row = record.to_wire(now)
            row["alive"] = True
            row.update(emitters.pop(record.instance_id, _NO_EMITTER))
            rows.append(row)
        for inst, emitter in emitters.items():  # emitting without registration (allowed)
            rows.append({"instance_id": inst, "alive": False, "registered": False, **emitter})
        rows.sort(key=lambda r: r["instance_id"])
        return rows

    def metrics_state(self) -> dict[str, Any]:
        return {
            "directory": directory_stats_wire(self.directory.stats()),
            "emitters": self.emitters_view(),
            "instances_alive": len(self.instances.snapshot()[1]),
            "mm_bypass": dict(MM_BYPASS_GUARD.reasons),
        }

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "state": self.state,
            **self.scheme.describe(),
            "blend_lookup": self.directory.blend_enabled,
            "event_transport": self.config.event_transport,
            "stream_position": self.stream_position,
        }


def directory_stats_wire(stats: DirectoryStats) -> dict[str, Any]:
    """``GET /directory/stats``'s body: the stats' fields, ``blend`` as ``{"enabled": ...}``
    plus the index's stats while blend lookup is on."""
    out = dataclasses.asdict(stats)
    blend = out["blend"]
    out["blend"] = {"enabled": False} if blend is None else {"enabled": True, **blend}
    return out


_NO_EMITTER = {
    "incarnation": None,
    "last_seq": None,
    "gaps": 0,
    "missing_batches": 0,
    "lag_s": None,
}
