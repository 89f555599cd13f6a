"""vLLM KV events in: decode + re-key engine batches into kvatlas chunks, with and without the
directory apply, vs a naive re-keyer; bytes per tracked block; the directory's consume rate for
node batches with and without a publisher observing it; what clients of a real coordinator see
while it applies a maximal message (:mod:`kvatlas.bench.kv_events_stall`)."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np

from kvatlas.bench.common import BenchRow, add_common_arguments, median_seconds, refuse, report
from kvatlas.bench.kv_events_stall import stall_rows
from kvatlas.coordinator.kv_events import Cleared, KvEventsPublisher, Rekeyer
from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.msgpack_codec import decode_msgpack_columns, encode_msgpack
from kvatlas.events.vllm_wire import (
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    split_batch,
)
from kvatlas.keys import KeyScheme, ObjectKey, chunk_hashes, pack_kv_rank


def naive_rekey(payloads: list[bytes], chunk_size: int) -> int:
    """The first code one would write: every block remembers its parent and its own tokens; a
    stored event rebuilds its parent's prefix and hashes it, plus its tokens, from the start.
    Returns the chunks the events completed (as the re-keyer counts them)."""
    blocks: dict[bytes | int, tuple[bytes | int | None, list[int]]] = {}

    def prefix(h: bytes | int | None) -> list[int]:
        pieces = []
        while h is not None:
            h, own = blocks[h]
            pieces.append(own)
        return [t for own in reversed(pieces) for t in own]

    chunks = 0
    for payload in payloads:
        for event in decode_batch(payload).events:
            assert isinstance(event, BlockStored)
            tokens = prefix(event.parent_block_hash)
            done = len(tokens) // chunk_size  # chunks complete before this event
            previous, size = event.parent_block_hash, event.block_size
            for i, h in enumerate(event.block_hashes):
                own = event.token_ids[i * size : (i + 1) * size]
                blocks[h] = (previous, own)
                tokens += own
                previous = h
            chunks += len(chunk_hashes(np.asarray(tokens, np.uint32), chunk_size)) - done
    return chunks


def engine_payloads(
    rng: np.random.Generator, requests: int, tokens: int, block_size: int, prefill: int
) -> list[bytes]:
    """Each request's first ``prefill`` tokens stored as one event (no parent), then every
    further block as an event of its own with its parent, as an engine stores them while
    decoding (``prefill == tokens``: one event per request)."""
    payloads = []
    for _ in range(requests):
        ids = rng.integers(0, 150_000, tokens).tolist()
        hashes: list[bytes | int] = [rng.bytes(32) for _ in range(tokens // block_size)]
        first = prefill // block_size
        events = [BlockStored(hashes[:first], None, ids[:prefill], block_size, medium="GPU")]
        events += [
            BlockStored([hashes[k]], hashes[k - 1], ids[k * block_size : (k + 1) * block_size],
                        block_size, medium="GPU")
            for k in range(first, len(hashes))
        ]  # fmt: skip
        payloads += [encode_batch(KVEventBatch(1.0, [event], 0)) for event in events]
    return payloads


def coordinator_bytes_per_block(requests: int, tokens: int, block_size: int, chunk_size: int,
                                seed: int) -> float:  # fmt: skip
    """What a coordinator holds per tracked block, block map and directory (blend on): its
    resident memory's growth once ``requests`` engine batches of ``tokens`` are re-keyed and
    applied (the operator's figure; tracemalloc would add its own traces to it). Run in a
    fresh process (:func:`_memory_rows`): an earlier run's freed memory would hide the growth."""
    rng = np.random.default_rng(seed)
    payloads = engine_payloads(rng, requests, tokens, block_size, tokens)
    scheme = KeyScheme("blake3", chunk_size)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    warm, warm_map = KeyDirectory(chunk_size, enable_blend_lookup=True), Rekeyer(scheme, 1 << 30)
    for payload in payloads[:4]:  # compile the kernels first: their code is not the data's
        for op in warm_map.translate("warm", "m", split_batch(payload)):
            assert not isinstance(op, Cleared)
            warm.apply_columns([op])
    del warm, warm_map
    gc.collect()
    before = rss()
    directory = KeyDirectory(chunk_size, enable_blend_lookup=True)
    rekeyer = Rekeyer(scheme, 1 << 30)
    for payload in payloads:
        for op in rekeyer.translate("pod-a", "m", split_batch(payload)):
            assert not isinstance(op, Cleared)
            directory.apply_columns([op])
    gc.collect()
    return (rss() - before) / rekeyer.total_blocks


def _memory_rows(args: argparse.Namespace) -> list[BenchRow]:
    b, c = args.block_size, args.chunk_size
    requests = max(1, args.memory_blocks // (args.tokens // b))
    code = (
        "import json; from kvatlas.bench.kv_events import coordinator_bytes_per_block as f; "
        f"print(json.dumps(f({requests}, {args.tokens}, {b}, {c}, {args.seed})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    rss = float(json.loads(out.stdout.strip().splitlines()[-1]))
    blocks = requests * (args.tokens // b)
    return [
        BenchRow(
            f"coordinator memory per tracked block: block map + directory, blend on ({blocks} "
            "blocks, resident growth)",
            None, shown=f"{rss:.0f} B/block", extra={"blocks": blocks},
        )
    ]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--requests", type=int, default=400, help="engine batches (requests)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per request")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM block size, tokens")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvatlas chunk size, tokens")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument(
        "--memory-blocks", type=int, default=262_144,
        help="blocks tracked for the coordinator-memory-per-block row (a fresh process)",
    )  # fmt: skip
    parser.add_argument(
        "--max-message-blocks", type=int, default=500_000,
        help="blocks in the maximal message (the coordinator's --kv-events-max-blocks)",
    )  # fmt: skip
    parser.add_argument(
        "--only", choices=("rekey", "memory", "stall"), default=None,
        help="run one part only: rekey (in-process rates, bytes), memory (a coordinator's bytes "
        "per tracked block) or stall (a coordinator process applying maximal messages)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests, args.repeats, args.max_message_blocks = 50, 3, 50_000
        args.memory_blocks = 12_800
    rng = np.random.default_rng(args.seed)
    b, c, r = args.block_size, args.chunk_size, args.repeats
    if args.tokens < 2 * c or args.tokens % c:
        return refuse("kv_events", f"--tokens must be a multiple of --chunk-size ≥ {2 * c}")
    if args.max_message_blocks < 1:
        return refuse("kv_events", "--max-message-blocks must be ≥ 1")
    meta = {"requests": args.requests, "tokens": args.tokens, "block_size": b,
            "chunk_size": c, "repeats": r, "seed": args.seed,
            "max_message_blocks": args.max_message_blocks}  # fmt: skip
    rows = [] if args.only in ("stall", "memory") else _rekey_rows(args, rng)
    if args.only in (None, "memory"):
        rows += _memory_rows(args)
    if args.only in (None, "stall"):
        rows += stall_rows(rng, args.max_message_blocks, c, r)
    report("kvatlas bench kv_events", rows, args, meta)
    return 0


def _rekey_rows(args: argparse.Namespace, rng: np.random.Generator) -> list[BenchRow]:
    b, c, r = args.block_size, args.chunk_size, args.repeats
    tokens = args.tokens
    payloads = engine_payloads(rng, args.requests, tokens, b, tokens)
    blocks = args.requests * (tokens // b)
    scheme = KeyScheme("blake3", c)

    def rekey(payloads: list[bytes] = payloads) -> Rekeyer:
        rekeyer = Rekeyer(scheme, blocks + 1)
        for payload in payloads:
            rekeyer.translate("pod-a", "m", split_batch(payload))
        return rekeyer

    def rekey_and_apply() -> None:
        directory = KeyDirectory(c, enable_blend_lookup=True)
        rekeyer = Rekeyer(scheme, blocks + 1)
        for payload in payloads:
            for op in rekeyer.translate("pod-a", "m", split_batch(payload)):
                assert not isinstance(op, Cleared)
                directory.apply_columns([op])

    # Decoding: half of each request prefilled at once, then one block per event (the naive
    # code rebuilds and hashes the whole prefix for each).
    stepped = engine_payloads(rng, args.requests, tokens, b, tokens // 2 // c * c)
    for events in (payloads, stepped):
        assert rekey(events).counts["chunks_stored"] == naive_rekey(events, c)
    # Both re-keyers run in a coordinator, which freezes what it holds at start-up
    # (runtime.freeze_long_lived): without it every full collection here walks numba's and
    # numpy's objects, ≈30 ms each, the same for either re-keyer.
    gc.collect()
    gc.freeze()
    rows = [
        BenchRow(
            f"decode + re-key, per block: one event per request ({blocks} blocks, no parents)",
            median_seconds(rekey, r) / blocks,
            median_seconds(lambda: naive_rekey(payloads, c), r) / blocks,
            "",
            {"blocks": blocks},
        ),
        BenchRow(
            f"decode + re-key, per block: half prefilled, then one event per block ({blocks} "
            "blocks)",
            median_seconds(lambda: rekey(stepped), r) / blocks,
            median_seconds(lambda: naive_rekey(stepped, c), r) / blocks,
            "",
            {"events": len(stepped)},
        ),
        BenchRow(
            "decode + re-key + directory apply (blend on), per block: one event per request",
            median_seconds(rekey_and_apply, r) / blocks,
        ),
    ]
    gc.collect()
    tracemalloc.start()
    kept = rekey()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_block = round(held / kept.total_blocks)
    rows.append(BenchRow("block map, bytes per tracked block", None, shown=f"{per_block} B/block"))
    rows += _observer_rows(rng, c, r)
    return rows


def _observer_rows(rng: np.random.Generator, c: int, r: int) -> list[BenchRow]:
    """The HTTP/Redis ingest path's cost of the publisher hook: apply the same node bodies,
    decoded into columns as ``POST /events`` decodes them, into a directory without and with a
    publisher observing it (its thread not running, so only the hook and the queue are
    measured; decoding is outside the timing)."""
    rows_tokens = rng.integers(0, 150_000, (256, c)).astype(np.uint32)
    rank = pack_kv_rank(1, 0, 1, 0)
    entries = tuple(
        CacheEntry(ObjectKey(chunk_hashes(t, c)[0], "m", rank), 1024, t, 0) for t in rows_tokens
    )
    bodies = [encode_msgpack([EventBatch("node-1", 1, s, "store", "l1", "dram", entries=entries)])
              for s in range(1, 201)]  # fmt: skip

    def apply(observed: bool) -> float:
        directory = KeyDirectory(c)
        if observed:
            pub = KvEventsPublisher("inproc://bench", None, 10, directory, threading.Event())
            directory.observer = pub
        decoded = [decode_msgpack_columns(body) for body in bodies]
        started = time.perf_counter()
        for batches in decoded:
            directory.apply_columns(batches)
        return time.perf_counter() - started

    n = len(bodies) * len(entries)
    plain = statistics.median(apply(False) for _ in range(r)) / n
    observed = statistics.median(apply(True) for _ in range(r)) / n
    return [BenchRow("apply decoded node bodies, publisher observing (ref: none), per entry",
                     observed, plain, "≈ 1×")]  # fmt: skip
