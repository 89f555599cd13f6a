"""Bodies of store events for the service benchmark (random Llama 3 ids by default), and their
posting: one connection per emitter, each posting its own bodies in order."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.workloads import LLAMA3, Vocabulary, random_token_ids

CHUNK = 256
MODEL = "bench-model"


def store_batches(
    rng: np.random.Generator,
    n_entries: int,
    per_batch: int,
    instance: str,
    vocab: Vocabulary = LLAMA3,
) -> tuple[list[EventBatch], np.ndarray[Any, Any]]:
    tokens = random_token_ids(rng, (n_entries, CHUNK), vocab)
    rank = pack_kv_rank(1, 0, 1, 0)
    batches = []
    for b, start in enumerate(range(0, n_entries, per_batch)):
        entries = []
        for i in range(start, min(start + per_batch, n_entries)):
            (h,) = chunk_hashes(tokens[i], CHUNK)
            entries.append(
                CacheEntry(ObjectKey(h, MODEL, rank), 1 << 20, tokens[i], (i % 64) * CHUNK)
            )
        batches.append(
            EventBatch(
                instance, 1, b + 1, "store", "l1", "dram", ts=time.time(), entries=tuple(entries)
            )
        )
    return batches, tokens


def bodies_of(
    batches: list[EventBatch], per_post: int, encode: Callable[[list[EventBatch]], bytes]
) -> list[bytes]:
    return [encode(batches[i : i + per_post]) for i in range(0, len(batches), per_post)]


def post_all(url: str, bodies: list[bytes], content_type: str) -> float:
    """Post every body in order (one emitter); returns the wall time (:func:`post_streams`)."""
    return post_streams(url, [bodies], content_type)


def post_streams(url: str, streams: list[list[bytes]], content_type: str) -> float:
    """One connection per emitter, each posting its own bodies in order (as a fleet's emitters
    do); returns the wall time until every stream was applied."""
    headers = {"Content-Type": content_type}

    def post(bodies: list[bytes]) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            for body in bodies:
                client.post("/events", content=body, headers=headers).raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(streams)) as pool:
        list(pool.map(post, streams))
    return time.perf_counter() - start
