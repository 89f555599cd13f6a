"""What ``bench service`` does to a coordinator over HTTP, whichever coordinator it is (ours, or
LMCache's as the reference): apply pre-encoded event bodies and read the server process's CPU,
minor faults and resident memory around them; run blend lookups with the load generator. Both
sides get the same bytes: the workloads are built once, from the seed, before any server runs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from kvatlas.bench.ingest_bodies import CHUNK, MODEL, post_streams, store_batches
from kvatlas.bench.loadgen import build_post
from kvatlas.bench.server_cpu import (
    LoadResult,
    process_cpu_seconds,
    process_minor_faults,
    process_rss_bytes,
    run_python_load,
    run_wrk,
)
from kvatlas.client import encode_tokens_b64
from kvatlas.coordinator.runtime import TRIM_INTERVAL_S
from kvatlas.events import EventBatch
from kvatlas.workloads import Vocabulary, random_token_ids

SETTLE_S = TRIM_INTERVAL_S + 1.5
"""After the last JSON body: how long the server is left idle before its resident memory is
read again (the coordinator trims its heap every ``TRIM_INTERVAL_S``)."""

LOOKUP_PATH = "/directory/blend-lookup"


@dataclass(frozen=True)
class IngestRun:
    """One run of every stream on a fresh server (the warm-up body not counted): wall time,
    server CPU seconds, server minor page faults, growth of its resident memory (bytes), that
    growth again after the idle time, and the growth once the first half of each stream was
    applied."""

    wall_s: float
    cpu_s: float
    minor_faults: int
    rss_growth: int
    rss_growth_idle: int
    rss_growth_first_half: int


def timed_streams(
    url: str,
    pid: int,
    streams: list[list[bytes]],
    content_type: str,
    warmup: bytes,
    settle_s: float = 0.0,
) -> IngestRun:
    """Post ``warmup``, then every stream (one connection each, in order: the first half of
    each stream's bodies, the resident memory read, then the rest), then stay idle
    ``settle_s`` and read the resident memory again. The growth over the second halves is what
    the chunks themselves cost: the first large bodies also grow the heap by what applying one
    takes (the body, its copies, the decoder's buffers), once."""
    headers = {"Content-Type": content_type}
    httpx.post(f"{url}/events", content=warmup, headers=headers, timeout=120).raise_for_status()
    cpu0, faults0, rss0 = (
        process_cpu_seconds(pid),
        process_minor_faults(pid),
        process_rss_bytes(pid),
    )
    wall = post_streams(url, [s[: len(s) // 2] for s in streams], content_type)
    rss_half = process_rss_bytes(pid) - rss0
    wall += post_streams(url, [s[len(s) // 2 :] for s in streams], content_type)
    cpu, faults, rss = (
        process_cpu_seconds(pid) - cpu0,
        process_minor_faults(pid) - faults0,
        process_rss_bytes(pid) - rss0,
    )
    time.sleep(settle_s)
    return IngestRun(wall, cpu, faults, rss, process_rss_bytes(pid) - rss0, rss_half)


def second_half_entries(streams: list[list[bytes]], per_stream: int, per_body: int) -> int:
    """Entries ``streams`` post after the first half of their bodies (:func:`timed_streams`),
    each stream ``per_stream`` entries in bodies of ``per_body`` (its last body the rest)."""
    return sum(per_stream - min(per_stream, len(s) // 2 * per_body) for s in streams)


@dataclass(frozen=True)
class IngestFigures:
    """A server's ingest runs of ``entries`` entries each, as medians."""

    entries: int
    runs: tuple[IngestRun, ...]
    second_half: int | None = None
    """Entries posted in the streams' second halves (``None``: not known)."""

    def _median(self, field: Callable[[IngestRun], float]) -> float:
        return statistics.median(field(r) for r in self.runs)

    @property
    def cpu_per_entry_s(self) -> float:
        return self._median(lambda r: r.cpu_s) / self.entries

    @property
    def entries_per_s(self) -> float:
        return self.entries / self._median(lambda r: r.wall_s)

    @property
    def rss_per_chunk(self) -> float:
        return self._median(lambda r: r.rss_growth) / self.entries

    @property
    def rss_idle_per_chunk(self) -> float:
        return self._median(lambda r: r.rss_growth_idle) / self.entries

    @property
    def rss_second_half_per_chunk(self) -> float | None:
        """Growth a chunk over the streams' second halves (the heap already holds what
        applying a body takes): what a chunk costs, without what the first bodies cost once."""
        if not self.second_half:
            return None
        return self._median(lambda r: r.rss_growth - r.rss_growth_first_half) / self.second_half


@dataclass(frozen=True)
class LookupWorkload:
    """The chunks to index and the blend-lookup bodies (JSON, ``tokens_b64``) to send."""

    index_batches: list[EventBatch]
    bodies: list[bytes]
    vocab: Vocabulary


def rag_query(
    rng: np.random.Generator, index_tokens: np.ndarray[Any, Any], length: int, vocab: Vocabulary
) -> np.ndarray[Any, Any]:
    """≈50% cached chunks at random, non-aligned offsets, the rest new text."""
    parts, total = [], 0
    while total < length:
        if rng.random() < 0.5:
            part = index_tokens[int(rng.integers(len(index_tokens)))]
        else:
            part = random_token_ids(rng, int(rng.integers(1, CHUNK)), vocab)
        parts.append(part)
        total += len(part)
    return np.concatenate(parts)[:length]


def lookup_workload(
    rng: np.random.Generator, index_chunks: int, query_tokens: int, vocab: Vocabulary
) -> LookupWorkload:
    """``index_chunks`` chunks of ids from ``vocab`` and 64 RAG queries over them."""
    index_batches, index_tokens = store_batches(rng, index_chunks, 1024, "node-1", vocab)
    bodies = [
        json.dumps(
            {
                "tokens_b64": encode_tokens_b64(rag_query(rng, index_tokens, query_tokens, vocab)),
                "model_name": MODEL,
            }
        ).encode()
        for _ in range(64)
    ]
    return LookupWorkload(index_batches, bodies, vocab)


def matches_of(url: str, body: bytes) -> list[tuple[str, int, int]]:
    """One blend lookup's answer: ``(chunk_hash, old_st, cur_st)`` of each match."""
    reply = httpx.post(
        f"{url}{LOOKUP_PATH}",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    reply.raise_for_status()
    return [(m["chunk_hash"], m["old_st"], m["cur_st"]) for m in reply.json()["matches"]]


def run_lookups(
    url: str,
    pid: int,
    bodies: list[bytes],
    *,
    clients: int,
    seconds: float,
    repeats: int,
    use_wrk: bool,
    after_each: Callable[[], object] = lambda: None,
) -> list[LoadResult]:
    """A short warm-up, then ``repeats`` closed-loop load runs of ``seconds`` with ``clients``
    connections (``wrk``, or the Python load generator)."""
    port = int(url.rsplit(":", 1)[1])
    requests = [build_post("127.0.0.1", port, LOOKUP_PATH, body) for body in bodies]
    run_python_load("127.0.0.1", port, requests[:8], clients, 0.5, pid)  # warm-up
    results = []
    for _ in range(repeats):
        if use_wrk:
            result = run_wrk(url, LOOKUP_PATH, bodies, clients, seconds, pid)
        else:
            result = run_python_load("127.0.0.1", port, requests, clients, seconds, pid)
        results.append(result)
        after_each()
    return results


@dataclass(frozen=True)
class LookupFigures:
    """A server's lookup runs, as medians, and its answer to the first body."""

    runs: tuple[LoadResult, ...]
    first_matches: tuple[tuple[str, int, int], ...]

    @property
    def cpu_per_lookup_s(self) -> float:
        return statistics.median(r.per_request_cpu_s for r in self.runs)

    @property
    def requests_per_s(self) -> float:
        return statistics.median(r.requests / r.seconds for r in self.runs)

    @property
    def p50_s(self) -> float:
        return statistics.median(r.p50_s for r in self.runs)

    @property
    def p99_s(self) -> float:
        return statistics.median(r.p99_s for r in self.runs)

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.runs)

    @property
    def generator(self) -> str:
        return self.runs[0].generator
