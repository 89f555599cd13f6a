"""``bench directory``'s wire-body rows: bodies as ``POST /events`` gets them, decoded into
columns and applied, against the per-entry decode into objects and the naive directory —
bodies of 1,024 entries (the rate an entry) and a node's bodies of a chunk or a few (the time
a body: what a batch costs beyond its entries)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvatlas.bench.common import BenchRow
from kvatlas.bench.directory_workload import (
    CHUNK,
    NaiveDirectory,
    consume_all,
    median_time,
    workload,
)
from kvatlas.directory import KeyDirectory
from kvatlas.events import (
    ColumnBatch,
    EventBatch,
    decode_json,
    decode_json_columns,
    decode_msgpack,
    decode_msgpack_columns,
    encode_json,
    encode_msgpack,
)
from kvatlas.workloads import LLAMA3

SMALL_BATCHES = (1, 8)  # a node's single store; a vLLM step's chunks
CODECS = {
    "JSON": (encode_json, decode_json, decode_json_columns),
    "msgpack": (encode_msgpack, decode_msgpack, decode_msgpack_columns),
}
"""Each wire format's encoder, per-entry decoder (the reference's) and columnar decoder."""


def _apply_bodies(bodies: list[bytes], decode: Callable[[bytes], list[ColumnBatch]]) -> None:
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for body in bodies:
        d.apply_columns(decode(body))


def _consume_bodies(bodies: list[bytes], decode: Callable[[bytes], list[EventBatch]]) -> None:
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for body in bodies:
        consume_all(d, decode(body))


def body_rows(n: int, seed: int, repeats: int) -> list[BenchRow]:
    """Wire bodies (4 batches of 256 entries each, what ``POST /events`` gets) decoded into
    columns and applied with ``apply_columns``, against the per-entry path: decoded into
    objects and applied batch by batch with ``consume``. Same bodies, same directory after."""
    batches = workload(n, seed)
    rows = []
    for fmt, (encode, per_entry, columnar) in CODECS.items():  # Llama 3 ids (the default)
        bodies = [encode(batches[i : i + 4]) for i in range(0, len(batches), 4)]
        ours = partial(_apply_bodies, bodies, columnar)
        reference = partial(_consume_bodies, bodies, per_entry)
        ours_s = median_time(ours, repeats)
        ref_s = median_time(reference, repeats)
        rows.append(
            BenchRow(
                f"decode + apply {n:,} entries in {fmt} bodies, blend on: columns ({LLAMA3.label})",
                ours_s,
                ref_s,
                "",
                {
                    "entries/s": f"{n / ours_s:,.0f}",
                    "µs/entry": f"{ours_s / n * 1e6:.2f}",
                    "reference": "per-entry decode + consume",
                },
            )
        )
    return rows


def small_batches_row(fmt: str, size: int, n: int, seed: int, repeats: int) -> BenchRow:
    """Store batches of ``size`` new chunks, each its own ``fmt`` body (a node reports a chunk
    at a time, in msgpack; LMCache's workers in JSON; a vLLM step's KV events make a few chunks
    a batch), decoded into columns and applied into a directory already holding ``n`` chunks
    (filled untimed, afresh each pass): the time a body, against the naive directory's decode
    into objects and consume. What a batch costs beyond its entries shows here, not at 256 a
    batch."""
    encode, per_entry, columnar = CODECS[fmt]
    base = workload(n, seed)
    bodies = [
        encode([b]) for b in workload(min(n, 20_000), seed + 2, instance="node-1", batch=size)
    ]

    def time_bodies(target: Any, apply: Callable[[Any, bytes], object]) -> float:
        consume_all(target, base)
        gc.collect()
        start = time.perf_counter()
        for body in bodies:
            apply(target, body)
        return (time.perf_counter() - start) / len(bodies)

    def ours() -> float:
        directory = KeyDirectory(CHUNK, enable_blend_lookup=True)
        return time_bodies(directory, lambda d, body: d.apply_columns(columnar(body)))

    def naive() -> float:
        return time_bodies(NaiveDirectory(), lambda d, body: consume_all(d, per_entry(body)))

    ours_s = statistics.median(ours() for _ in range(repeats))
    naive_s = statistics.median(naive() for _ in range(repeats))
    return BenchRow(
        f"decode + apply {fmt} bodies of {size} new chunk{'s' * (size > 1)} "
        f"({n:,} held, blend on; {LLAMA3.label}), a body",
        ours_s,
        naive_s,
        "",
        {"µs/entry": f"{ours_s / size * 1e6:.2f}", "bodies": f"{len(bodies):,}"},
    )


def small_batches_rows(n: int, seed: int, repeats: int) -> list[BenchRow]:
    """:func:`small_batches_row` for each format and each of :data:`SMALL_BATCHES`."""
    return [
        small_batches_row(fmt, size, n, seed, repeats) for fmt in CODECS for size in SMALL_BATCHES
    ]
