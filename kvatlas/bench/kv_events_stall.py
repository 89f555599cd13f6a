"""The stall rows of ``kvatlas bench kv_events``: what clients of a real coordinator process see
while its subscriber applies one maximal vLLM message (``--kv-events-max-blocks`` blocks in one
batch, the most a batch may hold): the worst ``/healthz`` (GIL only), the worst prefix lookup
(the directory lock too), and how long the message took to apply.

The message is what vLLM would send (:func:`maximal_message`: ``encode_batch``'s ``vllm``
encoding, 16-token blocks, token ids drawn from a 128k vocabulary so most take 5 msgpack
bytes); the pollers run in this process, one request after another on a keep-alive connection.
The same pollers against the idle coordinator, for as long, give the machine's own floor.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np

from kvatlas.bench.common import BenchRow, progress
from kvatlas.coordinator.server import free_port
from kvatlas.events.vllm_wire import (
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    pack_seq,
)
from kvatlas.processes import spawn_service, stop

VOCAB = 128_000
MODEL = "llama"


def maximal_message(
    rng: np.random.Generator, blocks: int, block_size: int = 16, blocks_per_event: int = 128
) -> bytes:
    """``blocks`` stored blocks in one batch, as vLLM encodes it: one ``BlockStored`` per
    request of ``blocks_per_event`` blocks (2048 tokens), random 32-byte hashes and token ids
    below :data:`VOCAB`."""
    events: list[KVEvent] = []
    for start in range(0, blocks, blocks_per_event):
        n = min(blocks_per_event, blocks - start)
        ids = rng.integers(0, VOCAB, n * block_size).tolist()
        hashes: list[bytes | int] = [rng.bytes(32) for _ in range(n)]
        events.append(BlockStored(hashes, None, ids, block_size, medium="GPU"))
    return encode_batch(KVEventBatch(time.time(), events, 0))


class Poller(threading.Thread):
    """Requests one route again and again; keeps each answer's start, latency and JSON body."""

    def __init__(self, url: str, path: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.answers: list[tuple[float, float, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.halt.is_set():
                started = time.perf_counter()
                if self.body is None:
                    reply = client.get(self.path)
                else:
                    reply = client.post(self.path, json=self.body)
                reply.raise_for_status()
                self.answers.append((started, time.perf_counter() - started, reply.json()))

    def worst(self, since: float, until: float = float("inf")) -> float:
        """The longest answer among those started in ``[since, until)``."""
        return max((lat for t, lat, _ in self.answers if since <= t < until), default=0.0)

    def stop(self) -> None:
        self.halt.set()
        self.join()


def subscriber_stats(answer: Any) -> dict[str, int]:
    stats: dict[str, int] = answer["kv_events"]["subscriber"]
    return stats


class EngineCoordinator:
    """A coordinator process subscribed to a PUB socket of this process (the engine)."""

    def __init__(self, chunk_size: int, max_blocks: int, *extra: str) -> None:
        import zmq

        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        http = free_port()
        self.url = f"http://127.0.0.1:{http}"
        self.proc = spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(http),
             "--chunk-size", str(chunk_size), "--enable-blend-lookup",
             "--kv-events-subscribe", f"pod-a=tcp://127.0.0.1:{port}",
             "--kv-events-model", MODEL, "--kv-events-max-blocks", str(max_blocks), *extra],
            self.url,
        )  # fmt: skip
        self.seq = 0
        # one client for the polls (kvatlas/processes.py, is_healthy, says why)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def stats(self) -> dict[str, int]:
        return subscriber_stats(self.http.get("/healthz").json())

    def send(self, payload: bytes) -> None:
        self.pub.send_multipart([b"", pack_seq(self.seq), payload])
        self.seq += 1

    def send_until_applied(self, payload: bytes, timeout: float = 60.0) -> None:
        """Send (again, same seq: repeats are dropped) until applied: a new SUB socket joins
        late."""
        before = self.stats()["batches"]
        deadline = time.monotonic() + timeout
        while self.stats()["batches"] == before:
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator never applied the message")
            self.pub.send_multipart([b"", pack_seq(self.seq), payload])
            time.sleep(0.1)
        self.seq += 1

    def wait_applied(
        self, batches: int, tokens: list[int] | None = None, timeout: float = 600.0
    ) -> None:
        """Until ``batches`` engine batches were applied and, if given, a prefix lookup of
        ``tokens`` finds them all (the last request of the message: its data has landed)."""
        deadline = time.monotonic() + timeout
        while self.stats()["batches"] < batches or (tokens and not self.holds(tokens)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batches} never applied")
            time.sleep(0.005)

    def holds(self, tokens: list[int]) -> bool:
        body = {"token_ids": tokens, "model_name": MODEL}
        found = self.http.post("/directory/lookup", json=body).json()
        return any(h["instance_id"] == "pod-a" for h in found["prefix"])

    def close(self) -> None:
        stop([self.proc])
        self.http.close()
        self.pub.close(0)
        self.ctx.term()


def stall_rows(
    rng: np.random.Generator, blocks: int, chunk_size: int, repeats: int
) -> list[BenchRow]:
    """Send ``repeats`` maximal messages of ``blocks`` blocks, one after the other has been
    applied; each row is the median over them (the first one fills the block map, the later
    ones also evict as many blocks). Each message is another one (other tokens, other hashes):
    it counts as applied once the last request it stores is found."""
    payloads = [maximal_message(rng, blocks) for _ in range(repeats)]
    mb = len(payloads[0]) / 1e6
    small = maximal_message(rng, 1)
    coordinator = EngineCoordinator(chunk_size, blocks)
    lookup = {"token_ids": list(range(4 * chunk_size)), "model_name": MODEL}
    health, prefix = (
        Poller(coordinator.url, "/healthz"),
        Poller(coordinator.url, "/directory/lookup", lookup),
    )
    worst_health, worst_lookup, applied, slices, idle = [], [], [], [], []
    try:
        coordinator.send_until_applied(small)
        health.start()
        prefix.start()
        for payload in payloads:
            last = decode_batch(payload).events[-1]
            assert isinstance(last, BlockStored)
            quiet = time.perf_counter()
            time.sleep(2.0)  # the same pollers, nothing to apply: the machine's floor
            idle.append(max(health.worst(quiet), prefix.worst(quiet)))
            before = coordinator.stats()
            started = time.perf_counter()
            coordinator.send(payload)
            coordinator.wait_applied(before["batches"] + 1, list(last.token_ids))
            done = time.perf_counter()
            applied.append(done - started)
            worst_health.append(health.worst(started, done))
            worst_lookup.append(prefix.worst(started, done))
            slices.append(coordinator.stats().get("slices", 0) - before.get("slices", 0))
            progress("kv_events", f"maximal message: applied in {applied[-1]:.2f} s, worst "
                     f"/healthz {worst_health[-1] * 1e3:.0f} ms, worst lookup "
                     f"{worst_lookup[-1] * 1e3:.0f} ms, {slices[-1]} slices")  # fmt: skip
    finally:
        health.halt.set()
        prefix.halt.set()
        coordinator.close()
    what = f"{blocks} blocks, {mb:.1f} MB, vLLM encoding"
    extra = {"runs_ms": [round(w * 1e3) for w in worst_health], "slices": slices[-1]}
    return [
        BenchRow(f"worst /healthz while a maximal message is applied ({what})",
                 statistics.median(worst_health), extra=extra),
        BenchRow("worst prefix lookup (directory lock) meanwhile",
                 statistics.median(worst_lookup),
                 extra={"runs_ms": [round(w * 1e3) for w in worst_lookup]}),
        BenchRow("the same pollers, idle coordinator, 2 s (the machine's floor)",
                 statistics.median(idle), extra={"runs_ms": [round(w * 1e3) for w in idle]}),
        BenchRow(f"time to apply the maximal message ({what})", statistics.median(applied),
                 extra={"runs_s": [round(a, 2) for a in applied]}),
    ]  # fmt: skip
