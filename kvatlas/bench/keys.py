"""Key derivation speed: chunk hashing and multimodal identity values vs naive references."""

from __future__ import annotations

import argparse
import hashlib
import struct

import numpy as np
from blake3 import blake3

from kvatlas.bench.common import BenchRow, add_common_arguments, median_seconds, refuse, report
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
    """The obvious code: one ``struct.pack`` and one blake3 per chunk."""
    out, prev = [], NONE_HASH
    pack = struct.Struct(f">{chunk_size}I").pack
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        prev = blake3(prev + pack(*tokens[start : start + chunk_size])).digest()
        out.append(prev)
    return out


def naive_mm_values(identifier: object, length: int) -> tuple[int, ...]:
    """The plain per-block loop straight from the contract (same output type as the tuple API)."""
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
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")


IMAGES = 10
IMAGE_TOKENS = 1024


def image_items(n_tokens: int) -> list[MMItem]:
    """Up to ten 1024-token images spread over the prompt, every one inside it."""
    count = min(IMAGES, n_tokens // (2 * IMAGE_TOKENS))
    stride = n_tokens // max(1, count)
    return [
        MMItem.of(f"img-{i}", i * stride + (stride - IMAGE_TOKENS) // 2, IMAGE_TOKENS)
        for i in range(count)
    ]


def check_config(args: argparse.Namespace) -> str | None:
    """Why a configuration makes a row meaningless, or ``None``."""
    if args.chunk_size < 1 or args.tokens < 2 * args.chunk_size:
        return f"--tokens must hold at least two chunks of --chunk-size {args.chunk_size}"
    if args.tokens < 2 * IMAGE_TOKENS:
        return f"--tokens must hold at least one {IMAGE_TOKENS}-token image (>= {2 * IMAGE_TOKENS})"
    if args.mm_values < 8:
        return "--mm-values must be at least one SHA-256 block (8 values)"
    return None


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.tokens, args.mm_values, args.repeats = 16_384, 1 << 16, 3
    reason = check_config(args)
    if reason is not None:
        return refuse("keys", reason)
    rng = np.random.default_rng(args.seed)
    n, c, r = args.tokens, args.chunk_size, args.repeats
    tokens_u32 = rng.integers(0, 150_000, n).astype(np.uint32)
    tokens_i64 = tokens_u32.astype(np.int64)
    tokens_list = tokens_u32.tolist()
    expected = naive_chunk_hashes(tokens_list, c)
    assert chunk_hashes(tokens_u32, c) == expected, "chunk hashes differ from the naive reference"
    naive_hash_s = median_seconds(lambda: naive_chunk_hashes(tokens_list, c), max(3, r // 4))
    hash_s = median_seconds(lambda: chunk_hashes(tokens_u32, c), r)
    per_128k = hash_s * 131072 / n
    rows = [
        BenchRow(
            f"chunk_hashes {n} tok, uint32 array",
            hash_s,
            naive_hash_s,
            "≤ 1 ms per 128k tok",
            {"bit_identical": True, "per 128k tok": f"{per_128k * 1e3:.3f} ms"},
            met=per_128k <= 1e-3,
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

    extend_s = median_seconds(extend_one_chunk, r)  # the pair: the drop back hashes nothing
    rows.append(
        BenchRow(
            "incremental: +1 chunk on the cached chain, then back (pair)",
            extend_s,
            hash_s,
            "faster than recompute",
            met=extend_s < hash_s,
        )
    )

    m = args.mm_values
    clear_value_cache()
    identical = mm_hash_to_token_values("bench-image", m) == naive_mm_values("bench-image", m)
    counter = iter(range(1 << 30))

    def cold_tuple() -> None:
        mm_hash_to_token_values(f"bench-image-{next(counter)}", m)  # new identifier: uncached

    def cold_array() -> None:
        mm_hash_values(f"bench-image-{next(counter)}", m)

    naive_mm_s = median_seconds(lambda: naive_mm_values("bench-image", m), max(3, r // 4))
    tuple_s = median_seconds(cold_tuple, r)
    rows.append(
        BenchRow(
            f"mm_hash_to_token_values {m} values (cold, tuple)",
            tuple_s,
            naive_mm_s,
            "≥ 5× the per-block loop",
            {"bit_identical": identical, "reference": "per-block loop → tuple"},
            met=naive_mm_s / tuple_s >= 5,
        )
    )
    naive_array = lambda: np.array(naive_mm_values("bench-image", m), dtype=np.uint32)  # noqa: E731
    rows.append(
        BenchRow(
            f"mm_hash_values {m} values (cold, uint32 array)",
            median_seconds(cold_array, r),
            median_seconds(naive_array, max(3, r // 4)),
            extra={"reference": "per-block loop → uint32 array"},
        )
    )
    clear_value_cache()

    prompt = rng.integers(0, 150_000, n).astype(np.int64)
    items = image_items(n)
    scheme = KeyScheme("blake3", c)

    def tracker_keys() -> None:
        RequestTracker(prompt, items, scheme=scheme).chunk_hashes()

    cacheable = RequestTracker(prompt, items, scheme=scheme).uncacheable_reason is None

    rows.append(
        BenchRow(
            f"RequestTracker: {n} tok + {len(items)} images, substitute + hash",
            median_seconds(tracker_keys, r),
            extra={"cacheable": cacheable},
        )
    )
    meta = {"tokens": n, "chunk_size": c, "mm_values": m, "repeats": r, "seed": args.seed}
    report("kvatlas bench keys", rows, args, meta)
    return 0 if identical and cacheable else 1
