"""Directory benchmark: consume rate and memory (token-bearing stores, blend on), prefix
lookups, snapshot pause and restore rate (each restore in a fresh process, as a
coordinator's start: ``restore_probe.py``) — against a naive dict-of-dicts, tuple-of-ints
reference in the same run.

Token ids come from Llama 3's vocabulary (they do not fit 16 bits); the consume and memory
rows are repeated with Llama 2's (they do) as second rows, labelled as such."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvatlas.bench.common import (
    BenchRow,
    add_common_arguments,
    finished,
    progress,
    refuse,
    report,
)
from kvatlas.bench.directory_bodies import body_rows, small_batches_rows
from kvatlas.bench.directory_workload import (
    BATCH,
    CHUNK,
    NaiveDirectory,
    consume_all,
    median_time,
    workload,
)
from kvatlas.bench.restore_probe import restore_in_fresh_process
from kvatlas.bench.snapshot_stall import snapshot_stall_row
from kvatlas.directory import KeyDirectory, warm_up_kernels
from kvatlas.workloads import LLAMA2, LLAMA3, Vocabulary

PROMPT_KEYS = 128  # a 32k-token prompt's chunks
CONSUME_RATE, CHUNK_BYTES = 1_000_000, 900
"""quality.md's directory targets: consume (blend on) entries/s, bytes a chunk keeps."""
_T = TypeVar("_T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--entries", type=int, default=None, help="store entries to consume")
    parser.add_argument("--snapshot-keys", type=int, default=None, help="keys for snapshot cases")
    parser.add_argument(
        "--only",
        choices=("consume", "snapshot"),
        default=None,
        help="run one part only: consume (rates, memory, bodies) or snapshot (stall, restore)",
    )
    parser.add_argument(
        "--memory-chunks",
        type=int,
        default=10_000,
        help="chunks in the memory row (the targets hold from 10,000 on)",
    )


def _memory_per_chunk(
    make: Callable[[], Any], n: int, seed: int, vocab: Vocabulary = LLAMA3
) -> float:
    """Bytes retained per chunk (directory + token arrays + index) once the inputs are gone."""
    return _retained(make, n, seed, vocab)[0]


def _retained(
    make: Callable[[], _T], n: int, seed: int, vocab: Vocabulary = LLAMA3
) -> tuple[float, _T]:
    """Bytes retained per chunk by ``make()`` after consuming ``n`` chunks, and the target.
    The kernels are warmed and a smaller target consumes a few batches first, untraced: what
    a process allocates once (lazy imports, kernels compiled or loaded on first use) is not
    the target's."""
    warm_up_kernels()
    consume_all(make(), workload(2 * BATCH, seed + 1, vocab=vocab))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        target = make()
        batches = workload(n, seed, vocab=vocab)
        consume_all(target, batches)
        del batches
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return used / n, target


def memory_row(n: int, seed: int, vocab: Vocabulary = LLAMA3) -> BenchRow:
    """Directory bytes per chunk with blend on and off (token arrays, records, index: all
    that stays once the inputs are gone), and the blend index's own share (its arrays and
    references, the 32-byte hashes it reads included; ``BlendStats.index_bytes``)."""
    on, directory = _retained(lambda: KeyDirectory(CHUNK, enable_blend_lookup=True), n, seed, vocab)
    stats = directory.stats().blend
    assert stats is not None
    index = stats.index_bytes / n
    del directory
    off = _retained(lambda: KeyDirectory(CHUNK), n, seed, vocab)[0]
    return BenchRow(
        f"memory at {n:,} chunks (256 tokens, {vocab.label})",
        None,
        None,
        f"≤ {CHUNK_BYTES / 1000} KB/chunk blend on, index ≤ 128 B/chunk",
        {"blend off B/chunk": f"{off:,.0f}", "index B/chunk": f"{index:,.1f}"},
        met=on <= CHUNK_BYTES and index <= 128,
        shown=f"{on:,.0f} B/chunk",
    )


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    n = args.entries or (20_000 if quick else 200_000)
    snap_keys = args.snapshot_keys or (100_000 if quick else 1_000_000)
    repeats = max(1, args.repeats if not quick else min(args.repeats, 2))
    if min(n, snap_keys, args.memory_chunks) < BATCH:
        return refuse(
            "directory", f"--entries, --snapshot-keys and --memory-chunks must be at least {BATCH}"
        )
    rows: list[BenchRow] = []
    # The compiled kernels loaded first, as a serving process does before serving: else the
    # first timed row pays their cache loads (≈0.3 s; seconds on a cold cache).
    progress("directory", f"kernels ready in {warm_up_kernels():.2f} s")
    if args.only in (None, "consume"):
        progress("directory", f"consume: {n:,} entries, {repeats} repeats")
        rows += [
            finished("directory", r)
            for r in _consume_rows(n, args.memory_chunks, args.seed, repeats)
        ]
    if args.only in (None, "snapshot"):
        rows += _snapshot_rows(snap_keys, args.seed, repeats)
    report(
        "kvatlas bench directory",
        rows,
        args,
        {"seed": args.seed, "repeats": repeats, "entries": n, "snapshot_keys": snap_keys},
    )
    return 0


def _consume_rows(n: int, memory_chunks: int, seed: int, repeats: int) -> list[BenchRow]:
    """Consume rate and memory against the naive directory; decode + apply of wire bodies;
    then the consume and memory rows again with ids that fit 16 bits (the kinder case)."""
    rows: list[BenchRow] = []
    batches = workload(n, seed)

    def ours() -> None:
        consume_all(KeyDirectory(CHUNK, enable_blend_lookup=True), batches)

    def naive() -> None:
        consume_all(NaiveDirectory(), batches)

    def naive_no_blend() -> None:
        consume_all(NaiveDirectory(blend=False), batches)

    def ours_no_blend() -> None:
        consume_all(KeyDirectory(CHUNK), batches)

    ours_s = median_time(ours, repeats)
    naive_s = median_time(naive, repeats)
    plain_s = median_time(ours_no_blend, repeats)
    naive_plain_s = median_time(naive_no_blend, repeats)
    batches = []  # free the inputs before the memory pass
    mem_n = min(n, 50_000)
    ours_mem = _memory_per_chunk(lambda: KeyDirectory(CHUNK, enable_blend_lookup=True), mem_n, 1)
    naive_mem = _memory_per_chunk(NaiveDirectory, mem_n, 1)
    rows.append(
        BenchRow(
            f"consume {n:,} token-bearing store entries, blend on ({LLAMA3.label})",
            ours_s,
            naive_s,
            f"≥ {CONSUME_RATE // 1_000_000}M entries/s, ≤ {CHUNK_BYTES / 1000} KB/chunk",
            {
                "entries/s": f"{n / ours_s:,.0f}",
                "naive entries/s": f"{n / naive_s:,.0f}",
                "B/chunk": f"{ours_mem:,.0f}",
                "naive B/chunk": f"{naive_mem:,.0f}",
            },
            met=n / ours_s >= CONSUME_RATE and ours_mem <= CHUNK_BYTES,
        )
    )

    rows.append(memory_row(memory_chunks, 1))
    rows.append(
        BenchRow(
            f"consume {n:,} token-bearing store entries, blend off (directory alone)",
            plain_s,
            naive_plain_s,
            "",
            {"entries/s": f"{n / plain_s:,.0f}", "reference": "naive without its content index"},
        )
    )
    rows += body_rows(min(n, 50_000), seed, repeats)
    rows.append(_lookup_row(min(n, 100_000), seed, repeats))
    rows += small_batches_rows(min(n, 50_000), seed, repeats)
    rows.append(_kinder_consume_row(n, seed, repeats))
    rows.append(memory_row(memory_chunks, 1, LLAMA2))
    return rows


def _lookup_row(n: int, seed: int, repeats: int) -> BenchRow:
    """Prefix lookups in a directory of ``n`` chunks: the 128 keys of a 32k-token prompt (its
    chunks stored by one batch, as a node stores a request's), each key's placements and bound
    ids, against the naive directory's lookup of the same keys. Every chunk is in one prompt,
    each prompt looked up once a pass (in an order of their own): a pass reads the whole
    directory, not a few prompts left in the cache by the ones before."""
    batches = workload(n, seed)
    ours, naive = KeyDirectory(CHUNK, enable_blend_lookup=True), NaiveDirectory()
    consume_all(ours, batches)
    consume_all(naive, batches)
    keys = [e.key for b in batches for e in b.entries]
    prompts = [keys[i : i + PROMPT_KEYS] for i in range(0, len(keys), PROMPT_KEYS)]
    random.Random(seed).shuffle(prompts)
    del batches, keys

    def time_lookups(target: Any) -> float:
        def lookups() -> None:
            for keys in prompts:
                target.lookup(keys)

        return median_time(lookups, repeats) / len(prompts)

    ours_s, naive_s = time_lookups(ours), time_lookups(naive)
    return BenchRow(
        f"prefix lookup, {PROMPT_KEYS} keys of one stored batch, {n:,} chunks ({LLAMA3.label})",
        ours_s,
        naive_s,
        "",
        {"µs/key": f"{ours_s / PROMPT_KEYS * 1e6:.2f}", "reference": "naive dict lookups"},
    )


def _kinder_consume_row(n: int, seed: int, repeats: int) -> BenchRow:
    """The consume row with ids that fit 16 bits (Llama 2's vocabulary): the second row."""
    batches = workload(n, seed, vocab=LLAMA2)

    def ours() -> None:
        consume_all(KeyDirectory(CHUNK, enable_blend_lookup=True), batches)

    ours_s = median_time(ours, repeats)
    batches.clear()  # free the inputs before the memory pass
    mem = _memory_per_chunk(
        lambda: KeyDirectory(CHUNK, enable_blend_lookup=True), min(n, 50_000), 1, LLAMA2
    )
    return BenchRow(
        f"consume {n:,} token-bearing store entries, blend on ({LLAMA2.label})",
        ours_s,
        None,
        "",
        {"entries/s": f"{n / ours_s:,.0f}", "B/chunk": f"{mem:,.0f}"},
    )


def _snapshot_rows(snap_keys: int, seed: int, repeats: int) -> list[BenchRow]:
    """The snapshot stall (``bench/snapshot_stall.py``) and the restore rate, at ``snap_keys``."""
    rows: list[BenchRow] = []
    progress("directory", f"building {snap_keys:,} keys")
    # blend on, as a coordinator's: the snapshot saves the contents' fingerprints
    directory = KeyDirectory(CHUNK, enable_blend_lookup=True)
    consume_all(directory, workload(snap_keys, seed + 1))
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "directory.snap"
        (probe,) = workload(8, seed, instance="probe")
        row = snapshot_stall_row(directory, snap_keys, path, probe.entries, repeats)
        rows.append(finished("directory", row))
        saved = directory.key_count  # (with the stall probe's keys)
        del directory
        gc.collect()
        for blend in (False, True):
            restore_s, cpu_s, first_s = [], [], []
            for i in range(repeats):  # as a coordinator's start: fresh memory, warm kernels
                seconds, cpu, keys, first = restore_in_fresh_process(path, CHUNK, blend)
                if keys != saved:  # a row times a whole restore or none
                    raise RuntimeError(f"restored {keys:,} keys of {saved:,}")
                restore_s.append(seconds)
                cpu_s.append(cpu)
                if first is not None:
                    first_s.append(first)
                progress(
                    "directory",
                    f"restore {i + 1}/{repeats} (blend {'on' if blend else 'off'}): "
                    f"{restore_s[-1]:.2f} s, {cpu_s[-1]:.2f} s CPU",
                )
            restore = statistics.median(restore_s)
            row = BenchRow(
                f"restore {snap_keys:,} keys (blend {'on: the index rebuilt' if blend else 'off'}) "
                "in a fresh process",
                restore,
                None,
                "≥ 1M keys/s",
                {
                    "keys/s": f"{snap_keys / restore:,.0f}",
                    "process CPU": f"{statistics.median(cpu_s):.2f} s",
                    **(
                        {"first lookup": f"{statistics.median(first_s) * 1e3:.1f} ms"}
                        if first_s
                        else {}
                    ),
                },
                met=snap_keys / restore >= 1_000_000,
            )
            rows.append(finished("directory", row))
    return rows
