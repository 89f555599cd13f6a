"""One chaos run: start the fleet, run the workload, inject the seeded faults, measure how long
each takes to converge, then after a quiet period compare every replica with the truth."""

from __future__ import annotations

import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from kvatlas.node import NodeConfig
from kvatlas.soak.faults import (
    L2_FILL,
    NODE_KILL,
    NODE_PAUSE,
    REDIS_RESTART,
    REPLICA_KILL,
    Fault,
    schedule,
)
from kvatlas.soak.fleet import (
    L2_BACKENDS,
    LAYOUT_FLAGS,
    POOL,
    PRIVATE_NODES,
    STREAM,
    FleetSettings,
    SoakFleet,
)
from kvatlas.soak.truth import Difference, PlacementRow, compare, disk_bytes, node_truth
from kvatlas.soak.watch import ChangeWatch
from kvatlas.soak.workload import Workload

POLL_S = 0.2


@dataclass
class Sample:
    t: float
    stream_len: int | None
    used_memory: int | None
    disk: dict[str, int]


class Sampler:
    """Once a second: the stream's length, Redis ``used_memory`` and each private L2's disk
    bytes (Redis figures are ``None`` while it is down)."""

    def __init__(self, fleet: SoakFleet) -> None:
        self.fleet = fleet
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def take(self) -> Sample:
        xlen = memory = None
        try:
            client = self.fleet.redis.client()
            xlen = int(client.xlen(STREAM))
            memory = int(client.info("memory")["used_memory"])  # type: ignore[index]
        except redis.RedisError:
            pass
        disk = {n: disk_bytes(self.fleet.l2_dir(n)) for n in PRIVATE_NODES}
        return Sample(time.monotonic() - self._t0, xlen, memory, disk)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(self.take())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass
class Outcome:
    fault: Fault
    injected_at: float
    repaired_at: float
    converged_s: float | None
    confirmed_s: float | None  # when the harness's comparison showed it (≥ converged_s)
    differences: dict[str, Difference] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.converged_s is not None:
            return f"converged in {self.converged_s:.2f} s (confirmed at {self.confirmed_s:.2f} s)"
        return "not converged: " + "; ".join(f"{r} {d}" for r, d in self.differences.items())

    def to_json(self) -> dict[str, Any]:
        return {
            **self.fault.to_json(),
            "injected_at": round(self.injected_at, 3),
            "repaired_at": round(self.repaired_at, 3),
            "converged_s": None if self.converged_s is None else round(self.converged_s, 3),
            "confirmed_s": None if self.confirmed_s is None else round(self.confirmed_s, 3),
            "replicas": {r: d.to_json() for r, d in self.differences.items()},
        }


class Soak:
    def __init__(self, root: Path, seconds: float, seed: int, settings: FleetSettings) -> None:
        self.seconds, self.seed, self.settings = seconds, seed, settings
        self.plan = schedule(seed, seconds, settings)
        self.fleet = SoakFleet(root, settings)
        self.layout = NodeConfig(**LAYOUT_FLAGS).layout
        self.outcomes: list[Outcome] = []
        self.l2_index_drift = 0

    # ------------------------------------------------------------------ convergence

    def truth(self) -> set[PlacementRow]:
        rows: set[PlacementRow] = set()
        drift = 0
        for name, service in self.fleet.nodes.items():
            shared = name == POOL
            where = self.fleet.l2_dir(name)
            got = node_truth(name, service.url, where, L2_BACKENDS[shared], shared=shared)
            rows |= got.rows
            drift += got.l2_index_drift
        self.l2_index_drift = drift
        return rows

    def differences(self) -> dict[str, Difference]:
        truth = self.truth()
        return {rid: compare(truth, s.url) for rid, s in self.fleet.replicas.items()}

    def converge(
        self, since: float, timeout: float
    ) -> tuple[float | None, float | None, dict[str, Difference]]:
        """Poll until every replica agrees with the truth. Returns the seconds from ``since``
        to the last change a replica made before it agreed (:class:`ChangeWatch`: no replica
        changed during the agreeing comparison) and to the end of that comparison, with its
        differences; ``None`` for both when ``timeout`` passed first (the last differences).
        Replicas that agreed but never stood still until then are dated by the comparison."""
        deadline = since + timeout
        watch = ChangeWatch({rid: s.url for rid, s in self.fleet.replicas.items()})
        watch.start()
        try:
            while True:
                began = time.monotonic()
                try:
                    diffs = self.differences()
                except Exception as exc:  # a node's inventory could not be read
                    diffs = {"truth": Difference(frozenset(), frozenset(), repr(exc))}
                agreed = all(d.agrees for d in diffs.values())
                if agreed:
                    confirmed = time.monotonic() - since
                    settled = watch.settled_at()
                    if settled is not None and settled <= began:
                        return max(0.0, settled - since), confirmed, diffs
                    # a replica changed while it was read: compare again
                if time.monotonic() > deadline:  # (agreeing, but never still: undated)
                    return (confirmed, confirmed, diffs) if agreed else (None, None, diffs)
                time.sleep(POLL_S)
        finally:
            watch.stop()

    # ------------------------------------------------------------------ faults

    def inject(self, fault: Fault, workload: Workload, t0: float) -> Outcome:
        """Inject ``fault`` while the workload runs; quiesce the workload, repair, and time
        the convergence from the repair (the workload resumes afterwards)."""
        fleet, injected = self.fleet, time.monotonic() - t0
        if fault.kind in (NODE_KILL, NODE_PAUSE):
            workload.available = workload.available - {fault.target}
        if fault.kind == NODE_KILL:
            fleet.nodes[fault.target].kill()
            time.sleep(fault.hold)
            workload.pause()
            fleet.nodes[fault.target].start()
        elif fault.kind == REPLICA_KILL:
            fleet.replicas[fault.target].kill()
            time.sleep(fault.hold)
            workload.pause()
            fleet.replicas[fault.target].start()
        elif fault.kind == REDIS_RESTART:
            fleet.redis.kill()
            time.sleep(fault.hold)
            workload.pause()
            fleet.redis.start()
        elif fault.kind == NODE_PAUSE:
            fleet.nodes[fault.target].signal(signal.SIGSTOP)
            time.sleep(fault.hold)
            fleet.nodes[fault.target].signal(signal.SIGCONT)
        elif fault.kind == L2_FILL:
            workload.pause()
            workload.fill_l2(fault.target, fault.chunks)
        repaired = time.monotonic()  # the clock runs from here, quiescing included
        workload.pause()  # (node_pause: after SIGCONT, so a call in flight to it returns)
        if fault.target in fleet.nodes:
            workload.available = workload.available | {fault.target}
        timeout = max(30.0, 5 * self.settings.convergence_target)
        converged, confirmed, diffs = self.converge(repaired, timeout)
        workload.resume()
        return Outcome(fault, injected, repaired - t0, converged, confirmed, diffs)

    # ------------------------------------------------------------------ the run

    def run(self, progress: Any = print) -> dict[str, Any]:
        fleet = self.fleet
        started = time.monotonic()
        try:
            fleet.start()
        except BaseException:  # stop what did start (Redis, a replica) before giving up
            fleet.stop()
            raise
        progress(f"fleet up in {time.monotonic() - started:.1f} s under {fleet.root}")
        sampler = Sampler(fleet)
        workload = Workload({n: s.url for n, s in fleet.nodes.items()}, self.layout, self.seed)
        try:
            sampler.start()
            t0 = time.monotonic()
            workload.start()
            for fault in self.plan:
                time.sleep(max(0.0, t0 + fault.at - time.monotonic()))
                outcome = self.inject(fault, workload, t0)
                self.outcomes.append(outcome)
                progress(f"{outcome.injected_at:7.1f} s  {fault.kind} {fault.target}: {outcome}")
            time.sleep(max(0.0, t0 + self.seconds - time.monotonic()))
            workload.pause()
            quiet = time.monotonic()
            settled, _, final = self.converge(
                quiet, max(30.0, 5 * self.settings.convergence_target)
            )
            progress(
                f"quiet period: {'never agreed' if settled is None else f'agreed after {settled:.2f} s'}"
            )
            sampler.stop()
            events = self._entries_added()
            return self.result(workload, sampler.samples, final, settled, events)
        finally:
            workload.close()
            sampler.stop()
            fleet.stop()

    def _entries_added(self) -> int | None:
        try:
            info: Any = self.fleet.redis.client().xinfo_stream(STREAM)
            return int(info["entries-added"]) if "entries-added" in info else None
        except redis.RedisError:
            return None

    def result(
        self,
        workload: Workload,
        samples: list[Sample],
        final: dict[str, Difference],
        settled: float | None,
        events: int | None,
    ) -> dict[str, Any]:
        s = self.settings
        half = len(samples) // 2
        memory = [x.used_memory for x in samples if x.used_memory is not None]
        mem_half = len(memory) // 2
        lengths = [x.stream_len for x in samples if x.stream_len is not None]

        def median(values: list[int]) -> float | None:
            return statistics.median(values) if values else None

        disk = {
            n: {
                "cap_bytes": s.l2_max_bytes,
                "max_bytes": max((x.disk[n] for x in samples), default=0),
                "first_half_median": median([x.disk[n] for x in samples[:half]]),
                "last_half_median": median([x.disk[n] for x in samples[half:]]),
            }
            for n in PRIVATE_NODES
        }
        return {
            "seconds": self.seconds,
            "seed": self.seed,
            "settings": {
                "heartbeat_s": s.heartbeat,
                "digest_interval_s": s.digest_interval,
                "instance_timeout_s": s.instance_timeout,
                "snapshot_interval_s": s.snapshot_interval,
                "stream_max_len": s.stream_max_len,
                "l1_bytes": s.l1_chunks * s.chunk_bytes,
                "l2_max_bytes": s.l2_max_bytes,
                "convergence_target_s": s.convergence_target,
            },
            "schedule": [f.to_json() for f in self.plan],
            "faults": [o.to_json() for o in self.outcomes],
            "events": events,
            "workload": workload.tally.to_json(),
            "final": {
                "settled_s": None if settled is None else round(settled, 3),
                "replicas": {r: d.to_json() for r, d in final.items()},
                "l2_index_drift": self.l2_index_drift,
            },
            "redis": {
                "stream_max_len": s.stream_max_len,
                "stream_len_max": max(lengths, default=None),
                "stream_len_end": lengths[-1] if lengths else None,
                "used_memory_first_half_median": median(memory[:mem_half]),
                "used_memory_last_half_median": median(memory[mem_half:]),
                "used_memory_third_quarter_median": median(
                    memory[mem_half : mem_half + (len(memory) - mem_half) // 2]
                ),
                "used_memory_last_quarter_median": median(
                    memory[mem_half + (len(memory) - mem_half) // 2 :]
                ),
                "samples": len(samples),
            },
            "disk": disk,
        }
