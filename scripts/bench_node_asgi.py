"""The node's app called in-process over ASGI, without an HTTP server: the CPU time of the
request stack and handlers alone (``time.process_time``, every thread) per ``POST
/engine/store``, ``/engine/lookup``, ``/engine/retrieve`` and ``/peer/kv``, for the ``kvatlas``
on ``PYTHONPATH``. Prints ``op microseconds`` lines (the median of ``--rounds``); used by
``scripts/bench_node_routes.py --asgi`` to compare two trees run after one another."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import msgspec
import numpy as np

from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import create_node_app
from kvatlas.workloads import random_token_ids

C, LAYERS, HEADS, DIM, CHUNKS = 16, 2, 2, 64, 4
MSGPACK = [(b"content-type", b"application/msgpack"), (b"accept", b"application/msgpack")]


def operations() -> dict[str, tuple[str, bytes, list[tuple[bytes, bytes]]]]:
    tokens = random_token_ids(np.random.default_rng(0), CHUNKS * C)  # a 128k-id vocabulary
    kv = np.zeros(2 * LAYERS * HEADS * C * DIM * CHUNKS, dtype=np.float16).tobytes()
    call = {"tokens": tokens.tobytes()}
    keys = [
        ObjectKey(h, "toy", pack_kv_rank(1, 0, 1, 0), 0, "").to_wire()
        for h in chunk_hashes(tokens, C)
    ]
    store = {**call, "kv": kv, "n_chunks": CHUNKS}
    return {
        "store": ("/engine/store", msgspec.msgpack.encode(store), MSGPACK),
        "lookup": ("/engine/lookup", msgspec.msgpack.encode(call), MSGPACK),
        "retrieve": ("/engine/retrieve", msgspec.msgpack.encode(call), MSGPACK),
        "peer_fetch": (
            "/peer/kv",
            msgspec.json.encode({"keys": keys}),
            [(b"content-type", b"application/json")],
        ),
    }


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
        dtype="float16", l1_bytes=1 << 26, l2="none",
    )  # fmt: skip
    node = CacheNode(config, instance_id="n1")
    app = create_node_app(node)
    ops = operations()
    seconds: dict[str, list[float]] = {}
    for _ in range(rounds):
        for op, (path, body, headers) in ops.items():
            t0 = time.process_time()
            for _ in range(requests):
                await call(app, path, body, headers)
            seconds.setdefault(op, []).append((time.process_time() - t0) / requests)
    node.close()
    for op, values in seconds.items():
        print(op, f"{statistics.median(values) * 1e6:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
