"""The snapshot row of ``kvatlas bench directory``: the longest stall a concurrent ingesting
thread observes while a snapshot is written — not the lock hold the writer reports about itself.

A stall is whatever keeps the probe from completing its next batch: the directory lock, a call
that holds the GIL, a garbage collection, or the operating system running other processes. So
the row also measures, for the same duration, the same probe alone (the machine) and beside a
thread running plain Python (the floor for any work sharing the GIL), and counts the
collections during the snapshot (``gc.callbacks``). It runs with the coordinator's GIL switch
interval (:data:`~kvatlas.coordinator.runtime.SWITCH_INTERVAL_S`): the coordinator is what
takes snapshots while clients ingest.
"""

from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from kvatlas.bench.common import BenchRow, format_seconds, progress
from kvatlas.coordinator.runtime import SWITCH_INTERVAL_S
from kvatlas.directory import KeyDirectory, SnapshotInfo, save_snapshot
from kvatlas.events import CacheEntry, EventBatch

_T = TypeVar("_T")


class StallProbe(threading.Thread):
    """A concurrent ingesting client: consumes small store batches back to back and records the
    longest gap between two consecutive completions — the stall a client observes, whatever
    causes it (the directory lock, a GIL-holding call, a collection).

    It also records the most CPU time the thread that started it (the one running the measured
    section) used within one gap: an upper bound of that thread's longest GIL hold, so a stall
    much longer than it was the operating system running other processes."""

    def __init__(self, directory: KeyDirectory, entries: tuple[CacheEntry, ...]) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.entries = entries
        self.stop = threading.Event()
        self.longest = 0.0
        self.section_cpu = 0.0
        self.batches = 0
        self._section_clock = time.pthread_getcpuclockid(threading.get_ident())

    def run(self) -> None:
        seq, last = 0, time.perf_counter()
        cpu_last = time.clock_gettime(self._section_clock)
        while not self.stop.is_set():
            seq += 1
            self.directory.consume(
                EventBatch("probe", 1, seq, "store", "l1", "dram", False, 0.0, self.entries)
            )
            now, cpu = time.perf_counter(), time.clock_gettime(self._section_clock)
            self.longest = max(self.longest, now - last)
            self.section_cpu = max(self.section_cpu, cpu - cpu_last)
            last, cpu_last = now, cpu
        self.batches = seq

    def __enter__(self) -> StallProbe:
        self.start()
        time.sleep(0.05)  # running before the measured section starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()


def probe_stall(
    directory: KeyDirectory, section: Callable[[], _T], entries: tuple[CacheEntry, ...]
) -> tuple[StallProbe, _T]:
    """The probe that ingested while ``section`` ran (``longest``: the longest stall it
    observed), and what ``section`` returned."""
    with StallProbe(directory, entries) as probe:
        result = section()
    return probe, result


def busy_python(seconds: float) -> None:
    """Plain Python bytecode for ``seconds`` (no long C call): a GIL-sharing competitor that
    gives way at every switch interval."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i in range(200):
            i * i


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class Collections:
    """The collections that ran (generation, seconds) while it was entered (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float]] = []
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.runs.append((info["generation"], time.perf_counter() - self._started))

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def snapshot_stall_row(
    directory: KeyDirectory,
    keys: int,
    path: Path,
    entries: tuple[CacheEntry, ...],
    repeats: int,
) -> BenchRow:
    """Snapshot ``directory`` (``keys`` keys) to ``path`` ``repeats`` times with the probe
    ingesting ``entries``; each time also the probe alone and beside plain Python for as long
    as the snapshot took."""
    stalls: list[float] = []
    held: list[float] = []
    alone: list[float] = []
    beside: list[float] = []
    infos: list[SnapshotInfo] = []
    full: list[int] = []
    longest_gc: list[float] = []
    with switch_interval(SWITCH_INTERVAL_S):
        for i in range(repeats):
            with Collections() as collections:
                probe, info = probe_stall(
                    directory, partial(save_snapshot, directory, path, stream_position="0-0"),
                    entries,
                )  # fmt: skip
            stalls.append(probe.longest)
            held.append(probe.section_cpu)
            infos.append(info)
            full.append(sum(1 for gen, _ in collections.runs if gen == 2))
            longest_gc.append(max((s for _, s in collections.runs), default=0.0))
            alone.append(
                probe_stall(directory, partial(time.sleep, info.seconds), entries)[0].longest
            )
            beside.append(
                probe_stall(directory, partial(busy_python, info.seconds), entries)[0].longest
            )
            progress(
                "directory",
                f"snapshot {i + 1}/{repeats}: {info.seconds:.2f} s; longest stall "
                f"{format_seconds(stalls[-1])} (alone {format_seconds(alone[-1])}, "
                f"beside Python {format_seconds(beside[-1])})",
            )
    stall = statistics.median(stalls)
    return BenchRow(
        f"snapshot at {keys:,} keys: longest stall a concurrent ingesting thread sees",
        stall,
        None,
        "≤ 10 ms",
        {
            "same thread, as long, alone": format_seconds(statistics.median(alone)),
            "beside plain Python (floor)": format_seconds(statistics.median(beside)),
            "writer CPU within one stall": format_seconds(statistics.median(held)),
            "lock hold (self-reported)": format_seconds(
                statistics.median(i.max_pause_s for i in infos)
            ),
            "longest collection": format_seconds(statistics.median(longest_gc)),
            "full collections": max(full),
            "snapshot total": f"{statistics.median(i.seconds for i in infos):.2f} s",
            "file MB": f"{path.stat().st_size / 1e6:,.0f}",
            "switch interval": format_seconds(SWITCH_INTERVAL_S),
        },
        met=stall <= 10e-3,
    )
