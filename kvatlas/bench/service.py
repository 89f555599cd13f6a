"""The coordinator end to end over HTTP: event ingestion (JSON vs msgpack, and a naive
reference service) and blend-lookup throughput/latency with concurrent clients."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from rich.progress import Progress

from kvatlas.bench.common import BenchRow, add_common_arguments, report
from kvatlas.client.coordinator_client import encode_tokens_b64
from kvatlas.events import CacheEntry, EventBatch, encode_json, encode_msgpack
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank

CHUNK = 256
MODEL = "bench-model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=3)
    parser.add_argument(
        "--entries", type=int, default=100_000, help="store entries to ingest per run"
    )
    parser.add_argument("--batch-entries", type=int, default=256, help="entries per batch")
    parser.add_argument("--batches-per-post", type=int, default=4, help="batches per POST body")
    parser.add_argument(
        "--index-chunks", type=int, default=100_000, help="chunks indexed for lookups"
    )
    parser.add_argument("--query-tokens", type=int, default=32_768)
    parser.add_argument("--clients", type=int, default=8, help="concurrent blend-lookup clients")
    parser.add_argument(
        "--lookup-seconds", type=float, default=5.0, help="duration of the lookup load"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")


def _spawn(args: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"service on port {port} did not start")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _store_batches(
    rng: np.random.Generator, n_entries: int, per_batch: int, instance: str
) -> tuple[list[EventBatch], np.ndarray[Any, Any]]:
    tokens = rng.integers(0, 150_000, (n_entries, CHUNK), dtype=np.uint32)
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


def _bodies(
    batches: list[EventBatch], per_post: int, encode: Callable[[list[EventBatch]], bytes]
) -> list[bytes]:
    return [encode(batches[i : i + per_post]) for i in range(0, len(batches), per_post)]


def _post_all(
    url: str, bodies: list[bytes], content_type: str, warmup: bytes | None = None
) -> float:
    """Post every body in order; the optional warm-up (another emitter) loads compiled kernels
    before the clock starts, so a fresh process's one-off JIT cache load is not counted."""
    with httpx.Client(base_url=url, timeout=120) as client:
        if warmup is not None:
            client.post(
                "/events", content=warmup, headers={"Content-Type": content_type}
            ).raise_for_status()
        start = time.perf_counter()
        for body in bodies:
            response = client.post("/events", content=body, headers={"Content-Type": content_type})
            response.raise_for_status()
        return time.perf_counter() - start


async def _lookup_load(url: str, bodies: list[bytes], clients: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                body = bodies[i % len(bodies)]
                start = time.perf_counter()
                response = await client.post(
                    "/directory/blend-lookup",
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)
                i += clients

        await asyncio.gather(*(worker(k) for k in range(clients)))
    return latencies


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.entries, args.index_chunks, args.lookup_seconds = 10_000, 10_000, 2.0
    rng = np.random.default_rng(args.seed)
    rows: list[BenchRow] = []
    meta: dict[str, Any] = vars(args).copy()
    meta.pop("json", None)

    with Progress(transient=True) as progress:
        task = progress.add_task("ingestion over HTTP", total=args.repeats * 3 + 2)
        batches, _ = _store_batches(rng, args.entries, args.batch_entries, "node-0")
        json_bodies = _bodies(batches, args.batches_per_post, encode_json)
        msgpack_bodies = _bodies(batches, args.batches_per_post, encode_msgpack)
        warm, _ = _store_batches(rng, 64, 64, "warm-up")
        warmups = {"json": encode_json(warm), "msgpack": encode_msgpack(warm)}
        times: dict[str, list[float]] = {"json": [], "msgpack": [], "naive": []}
        for _ in range(args.repeats):
            for fmt, bodies, ctype in (
                ("json", json_bodies, "application/json"),
                ("msgpack", msgpack_bodies, "application/msgpack"),
            ):
                port = _free_port()
                proc = _spawn(
                    [
                        "-m",
                        "kvatlas.cli",
                        "coordinator",
                        "--port",
                        str(port),
                        "--enable-blend-lookup",
                    ],
                    port,
                )
                try:
                    times[fmt].append(
                        _post_all(f"http://127.0.0.1:{port}", bodies, ctype, warmups[fmt])
                    )
                finally:
                    proc.terminate()
                    proc.wait()
                progress.advance(task)
            port = _free_port()
            proc = _spawn(["-m", "kvatlas.bench.naive_service", str(port)], port)
            try:
                times["naive"].append(
                    _post_all(
                        f"http://127.0.0.1:{port}", json_bodies, "application/json", warmups["json"]
                    )
                )
            finally:
                proc.terminate()
                proc.wait()
            progress.advance(task)
        naive_s = statistics.median(times["naive"])
        for fmt in ("json", "msgpack"):
            ours = statistics.median(times[fmt])
            rows.append(
                BenchRow(
                    f"ingest {args.entries} token-bearing entries, {fmt} (blend on)",
                    ours,
                    naive_s,
                    "≥ 100k entries/s",
                    {
                        "entries_per_s": f"{args.entries / ours:,.0f}",
                        "naive_entries_per_s": f"{args.entries / naive_s:,.0f}",
                    },
                )
            )

        # Blend lookup under load: index populated, 8 concurrent clients, 32k-token RAG queries.
        port = _free_port()
        proc = _spawn(
            [
                "-m",
                "kvatlas.cli",
                "coordinator",
                "--port",
                str(port),
                "--enable-blend-lookup",
                "--max-body-bytes",
                str(1 << 30),
            ],
            port,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            index_batches, index_tokens = _store_batches(rng, args.index_chunks, 1024, "node-1")
            _post_all(url, _bodies(index_batches, 4, encode_msgpack), "application/msgpack")
            progress.advance(task)
            bodies = []
            for _ in range(64):
                parts, length = [], 0
                while length < args.query_tokens:
                    if rng.random() < 0.5:
                        part = index_tokens[int(rng.integers(len(index_tokens)))]
                    else:
                        part = rng.integers(
                            0, 150_000, int(rng.integers(1, CHUNK)), dtype=np.uint32
                        )
                    parts.append(part)
                    length += len(part)
                query = np.concatenate(parts)[: args.query_tokens]
                payload = {"tokens_b64": encode_tokens_b64(query), "model_name": MODEL}
                bodies.append(httpx.Request("POST", url, json=payload).content)
            asyncio.run(_lookup_load(url, bodies[:8], args.clients, 0.5))  # warm-up
            latencies = asyncio.run(_lookup_load(url, bodies, args.clients, args.lookup_seconds))
            progress.advance(task)
        finally:
            proc.terminate()
            proc.wait()
    latencies.sort()
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    rps = len(latencies) / args.lookup_seconds
    rows.append(
        BenchRow(
            f"blend-lookup {args.query_tokens} tok, {args.clients} clients, {args.index_chunks} chunks",
            p50,
            None,
            "≥ 1,000 req/s, p99 ≤ 20 ms",
            {
                "req_per_s": f"{rps:,.0f}",
                "p50_ms": f"{p50 * 1e3:.2f}",
                "p99_ms": f"{p99 * 1e3:.2f}",
            },
        )
    )
    report("kvatlas bench service", rows, args.json, meta)
    return 0
