"""The node's app called in-process over ASGI, without an HTTP server: the CPU time of the
request stack and handlers alone (``time.process_time``, every thread) per ``POST
/engine/store``, ``/engine/lookup``, ``/engine/retrieve`` and ``/peer/kv``, for the ``kvatlas``
on ``PYTHONPATH``. Prints ``op microseconds`` lines (the median of ``--rounds``); used by
``scripts/bench_node_routes.py --asgi`` to compare two trees run after one another.

The workload (:class:`Workload`, shared with ``bench_node_routes.py``): distinct prompts of 4
chunks, token ids from a 128k-id vocabulary; an L1 of 64 chunks of which 16 are pinned by the
operator (4 prompts), so every store inserts 4 new keys and evicts 4 (least recently used,
passing the pinned ones by); lookups, retrievals and peer fetches hit, each on a prompt L1
holds (the 8 last stored, in turn, and the pinned ones).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import deque
from typing import Any, Final

import msgspec
import numpy as np

from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import create_node_app
from kvatlas.workloads import random_token_ids

C, LAYERS, HEADS, DIM, CHUNKS = 16, 2, 2, 64, 4
CHUNK_BYTES: Final = 2 * LAYERS * HEADS * C * DIM * 2  # float16 K and V of one chunk
L1_CHUNKS: Final = 64
L1_BYTES: Final = L1_CHUNKS * CHUNK_BYTES
PINNED_PROMPTS: Final = 4  # 16 chunks: a quarter of L1
RESIDENT: Final = 8  # the last stored prompts that reads go to (L1 holds 12 besides the pinned)
PROMPTS: Final = 512  # stored in turn: one comes back long after L1 evicted it
MSGPACK = [(b"content-type", b"application/msgpack"), (b"accept", b"application/msgpack")]
JSON = [(b"content-type", b"application/json")]
Call = tuple[str, bytes, list[tuple[bytes, bytes]]]
OPS: Final = ("store", "lookup", "retrieve", "peer_fetch")


def prompt_keys(tokens: np.ndarray[Any, Any]) -> list[ObjectKey]:
    return [ObjectKey(h, "toy", pack_kv_rank(1, 0, 1, 0), 0, "") for h in chunk_hashes(tokens, C)]


class Workload:
    """The calls of each op, in turn; stores go through the prompts, reads to what L1 holds."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        prompts = [random_token_ids(rng, CHUNKS * C) for _ in range(PINNED_PROMPTS + PROMPTS)]
        kv = np.zeros(2 * LAYERS * HEADS * C * DIM * CHUNKS, dtype=np.float16).tobytes()
        self.pinned = prompts[:PINNED_PROMPTS]
        self.stream = prompts[PINNED_PROMPTS:]
        self.store = [self._store(t, kv) for t in prompts]
        self.read = [msgspec.msgpack.encode({"tokens": t.tobytes()}) for t in prompts]
        self.peer = [
            msgspec.json.encode({"keys": [k.to_wire() for k in prompt_keys(t)]}) for t in prompts
        ]
        self._next = 0  # the next stream prompt to store
        self._recent: deque[int] = deque(maxlen=RESIDENT)  # stream prompts stored last
        self._read = 0

    @staticmethod
    def _store(tokens: np.ndarray[Any, Any], kv: bytes) -> bytes:
        return msgspec.msgpack.encode({"tokens": tokens.tobytes(), "kv": kv, "n_chunks": CHUNKS})

    def pinned_keys(self) -> list[ObjectKey]:
        return [k for t in self.pinned for k in prompt_keys(t)]

    def setup(self) -> list[Call]:
        """Store the pinned prompts and the first resident ones (pin the keys after)."""
        calls = [("/engine/store", self.store[i], MSGPACK) for i in range(PINNED_PROMPTS)]
        return calls + [self.call("store") for _ in range(RESIDENT)]

    def call(self, op: str) -> Call:
        if op == "store":
            i = self._next
            self._next = (i + 1) % PROMPTS
            self._recent.append(i)
            return "/engine/store", self.store[PINNED_PROMPTS + i], MSGPACK
        readable = [*range(PINNED_PROMPTS), *(PINNED_PROMPTS + i for i in self._recent)]
        j = readable[self._read % len(readable)]
        self._read += 1
        if op == "peer_fetch":
            return "/peer/kv", self.peer[j], JSON
        return f"/engine/{op}", self.read[j], MSGPACK


async def call(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "server": ("127.0.0.1", 9), "client": ("127.0.0.1", 5),
        "headers": [*headers, (b"content-length", str(len(body)).encode()),
                    (b"host", b"127.0.0.1")],
    }  # fmt: skip
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    assert status == [200], (path, status)


async def main(requests: int, rounds: int) -> None:
    config = NodeConfig(
        model_name="toy", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, chunk_size=C,
        dtype="float16", l1_bytes=L1_BYTES, l2="none",
    )  # fmt: skip
    node = CacheNode(config, instance_id="n1")
    app = create_node_app(node)
    work = Workload()
    for path, body, headers in work.setup():
        await call(app, path, body, headers)
    node.pins.replace(work.pinned_keys())  # what the node's pin poll would set
    seconds: dict[str, list[float]] = {}
    for _ in range(rounds):
        for op in OPS:
            calls = [work.call(op) for _ in range(requests)]
            t0 = time.process_time()
            for path, body, headers in calls:
                await call(app, path, body, headers)
            seconds.setdefault(op, []).append((time.process_time() - t0) / requests)
    pinned = work.pinned_keys()
    assert all(node.l1.contains(k) for k in pinned), "a pinned key was evicted"
    assert len(node.l1) == L1_CHUNKS, len(node.l1)  # full: every store evicted
    node.close()
    for op, values in seconds.items():
        print(op, f"{statistics.median(values) * 1e6:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
