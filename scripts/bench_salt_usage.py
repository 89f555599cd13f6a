"""L2 ingest into a KeyDirectory, and quota usage (``bytes_by_salt("l2")``) against the full
pass over the records, on the source tree in PYTHONPATH: run it for two trees in turn to
compare (docs/cache-control.md quotes a run). 204,800 L2 keys in 10 salts, 256 per batch: first
as new chunks, then the same keys from a second instance (known chunks); medians of 3; once
with one salt a batch, once with all 10 in every batch.

    for t in /tmp/base .; do TREE=$t PYTHONPATH=$t python scripts/bench_salt_usage.py; done
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from kvatlas.directory import KeyDirectory
from kvatlas.directory.salt_usage import bytes_by_salt
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey

N_BATCHES, PER_BATCH = 800, 256


def batches(mixed: bool) -> tuple[list[EventBatch], list[EventBatch]]:
    """``mixed``: every batch carries all 10 salts (a node serving several tenants at once:
    the counter's entry-by-entry path); else one salt per batch (its one-total path)."""
    rng = np.random.default_rng(1)
    salts = [f"t{i}" for i in range(10)]
    first = []
    for b in range(N_BATCHES):
        entries = tuple(
            CacheEntry(
                ObjectKey(rng.bytes(32), "m", 16777472, 0, salts[(i if mixed else b) % 10]),
                1 << 20,
                None,
                -1,
            )
            for i in range(PER_BATCH)
        )
        first.append(EventBatch("n1", 1, b + 1, "store", "l2", "fs", False, float(b), entries))
    again = [
        EventBatch("n2", 1, i + 1, "store", "l2", "fs", False, float(i), b.entries)
        for i, b in enumerate(first)
    ]
    return first, again


def timed(call: object) -> float:
    start = time.perf_counter()
    call()  # type: ignore[operator]
    return time.perf_counter() - start


def one_round(first: list[EventBatch], again: list[EventBatch]) -> tuple[float, ...]:
    d = KeyDirectory(256, enable_blend_lookup=False)
    fresh = timed(lambda: [d.consume(b) for b in first])
    known = timed(lambda: [d.consume(b) for b in again])
    usage = timed(lambda: d.bytes_by_salt("l2"))
    full = timed(lambda: bytes_by_salt(d._chunks, d._lock, "l2"))
    assert d.bytes_by_salt("l2") == bytes_by_salt(d._chunks, d._lock, "l2")
    return fresh, known, usage, full


def main() -> None:
    n = N_BATCHES * PER_BATCH
    for mixed in (False, True):
        first, again = batches(mixed)
        rounds = [one_round(first, again) for _ in range(3)]
        fresh, known, usage, full = (statistics.median(x) for x in zip(*rounds, strict=True))
        print(
            f"{os.environ.get('TREE', '.')} ({'10 salts' if mixed else 'one salt'} a batch): new "
            f"chunks {n / fresh:,.0f} entries/s, known chunks {n / known:,.0f} entries/s, "
            f"bytes_by_salt('l2') {usage * 1e3:.2f} ms, full pass {full * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
