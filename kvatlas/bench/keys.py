"""Key derivation speed: chunk hashing and multimodal identity values vs naive references."""

from __future__ import annotations

import argparse
import hashlib
import struct

import numpy as np
from blake3 import blake3

from kvatlas.bench.common import BenchRow, add_common_arguments, median_seconds, report
from kvatlas.keys import (
    NONE_HASH,
    ChunkHashChain,
    KeyScheme,
    MMItem,
    RequestTracker,
    chunk_hashes,
    clear_value_cache,
    mm_hash_to_token_values,
    mm_hash_values,
)


def naive_chunk_hashes(tokens: list[int], chunk_size: int) -> list[bytes]:
    """The reference's shape: pack every token with struct, one chunk at a time."""
    out, prev = [], NONE_HASH
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        packed = b"".join(struct.pack(">I", t) for t in tokens[start : start + chunk_size])
        prev = blake3(prev + packed).digest()
        out.append(prev)
    return out


def naive_mm_values(identifier: object, length: int) -> tuple[int, ...]:
    """The plain per-block loop straight from the contract."""
    seed = hashlib.sha256(str(identifier).encode("utf-8")).digest()
    values: list[int] = []
    for c in range((length + 7) // 8):
        block = hashlib.sha256(seed + c.to_bytes(8, "big")).digest()
        values.extend(w & 0x7FFFFFFF for w in struct.unpack(">8I", block))
    return tuple(values[:length])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=21)
    parser.add_argument("--tokens", type=int, default=131072, help="prompt length to hash")
    parser.add_argument("--mm-values", type=int, default=1 << 20, help="values to derive")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    n, c, r = args.tokens, args.chunk_size, args.repeats
    tokens_u32 = rng.integers(0, 150_000, n).astype(np.uint32)
    tokens_i64 = tokens_u32.astype(np.int64)
    tokens_list = tokens_u32.tolist()
    expected = naive_chunk_hashes(tokens_list, c)
    assert chunk_hashes(tokens_u32, c) == expected, "chunk hashes differ from the naive reference"
    naive_hash_s = median_seconds(lambda: naive_chunk_hashes(tokens_list, c), max(3, r // 4))
    rows = [
        BenchRow(
            f"chunk_hashes {n} tok, uint32 array",
            median_seconds(lambda: chunk_hashes(tokens_u32, c), r),
            naive_hash_s,
            "≤ 1 ms",
            {"bit_identical": True},
        ),
        BenchRow(
            f"chunk_hashes {n} tok, int64 array",
            median_seconds(lambda: chunk_hashes(tokens_i64, c), r),
            naive_hash_s,
        ),
        BenchRow(
            f"chunk_hashes {n} tok, Python list",
            median_seconds(lambda: chunk_hashes(tokens_list, c), r),
            naive_hash_s,
        ),
    ]

    chain = ChunkHashChain(c)
    chain.update(tokens_u32[: n - c])

    def extend_one_chunk() -> None:
        chain.update(tokens_u32)
        chain.update(tokens_u32[: n - c])  # drop the last chunk again for the next repeat

    rows.append(
        BenchRow(
            "incremental: +1 chunk on the cached chain",
            median_seconds(extend_one_chunk, r) / 2,
            median_seconds(lambda: chunk_hashes(tokens_u32, c), r),
            "extend, not recompute",
        )
    )

    m = args.mm_values
    clear_value_cache()
    identical = mm_hash_to_token_values("bench-image", m) == naive_mm_values("bench-image", m)
    counter = iter(range(1 << 30))

    def cold_values() -> None:
        mm_hash_values(f"bench-image-{next(counter)}", m)  # a new identifier: never cached

    rows.append(
        BenchRow(
            f"mm_hash_to_token_values {m} values (cold)",
            median_seconds(cold_values, r),
            median_seconds(lambda: naive_mm_values("bench-image", m), max(3, r // 4)),
            "≥ 5× the per-block loop",
            {"bit_identical": identical},
        )
    )
    clear_value_cache()

    prompt = rng.integers(0, 150_000, n).astype(np.int64)
    items = [MMItem.of(f"img-{i}", 1000 + i * 12_000, 1024) for i in range(10)]
    scheme = KeyScheme("blake3", c)

    def tracker_keys() -> None:
        RequestTracker(prompt, items, scheme=scheme).chunk_hashes()

    rows.append(
        BenchRow(
            f"RequestTracker: {n} tok + 10 images, substitute + hash",
            median_seconds(tracker_keys, r),
        )
    )
    meta = {"tokens": n, "chunk_size": c, "mm_values": m, "repeats": r, "seed": args.seed}
    report("kvatlas bench keys", rows, args.json, meta)
    return 0 if identical else 1
