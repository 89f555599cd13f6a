"""One move L1 -> L1 between two real ``kvatlas node`` processes on loopback, through a real
``kvatlas coordinator`` (``docs/cache-control.md``, "Moves"): stores ``--chunks`` chunks of a
Llama-3-8B-like layout (32 layers, 8 KV heads, head dim 128, fp16, ``--chunk-size`` tokens)
on node-a, asks the coordinator to move them to node-b and polls the status. Prints one JSON
line: the seconds from the request to ``completed``, when each phase was first seen, the
final status. For the ``kvatlas`` on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import json
import time

import httpx
import numpy as np

from kvatlas.asgi_thread import free_port
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.processes import spawn_services, stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=16)
    args = parser.parse_args()
    cs = args.chunk_size
    layout_flags = ["--model-name", "m", "--num-layers", "32", "--num-kv-heads", "8",
                    "--head-dim", "128", "--chunk-size", str(cs), "--dtype", "float16"]  # fmt: skip
    config = NodeConfig(model_name="m", num_layers=32, num_kv_heads=8, head_dim=128,
                        chunk_size=cs, dtype="float16", l2="none")  # fmt: skip
    cp, ap, bp = free_port(), free_port(), free_port()
    coordinator = f"http://127.0.0.1:{cp}"
    l1_bytes = str(max(1 << 30, 2 * args.chunks * config.layout.chunk_bytes))
    procs = spawn_services([(["-m", "kvatlas.cli", "coordinator", "--port", str(cp),
                              "--chunk-size", str(cs), "--log-level", "warning"], coordinator)])  # fmt: skip
    try:
        procs += spawn_services([
            (["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", name,
              *layout_flags, "--l2", "none", "--l1-bytes", l1_bytes, "--log-level", "warning",
              "--coordinator-url", coordinator, "--coordinator-event-reporting"],
             f"http://127.0.0.1:{port}")
            for name, port in (("node-a", ap), ("node-b", bp))
        ], timeout=180)  # fmt: skip
        rng = np.random.default_rng(1)
        tokens = rng.integers(0, 128_000, args.chunks * cs).astype(np.uint32)
        kv = rng.standard_normal((args.chunks, *config.layout.shape)).astype(np.float16)
        with NodeEngineClient(f"http://127.0.0.1:{ap}", config.layout) as client:
            assert client.store(tokens, list(kv)) == args.chunks
        lookup = {"token_ids": tokens.tolist(), "model_name": "m"}

        def on_a() -> int:
            rows = httpx.post(f"{coordinator}/directory/lookup", json=lookup, timeout=60)
            return sum(
                any(p["instance_id"] == "node-a" and p["tier"] == "l1" for p in r["placements"])
                for r in rows.json()["results"]
            )

        while on_a() < args.chunks:
            time.sleep(0.1)
        started = time.monotonic()
        body = {"model_name": "m", "world_size": 1, "token_ids": tokens.tolist(),
                "source_instance_id": "node-a", "target_instance_id": "node-b"}  # fmt: skip
        move_id = httpx.post(f"{coordinator}/cache/moves", json=body, timeout=60).json()["move_id"]
        phases: dict[str, float] = {}
        while True:
            status = httpx.get(f"{coordinator}/cache/moves/{move_id}").json()
            phases.setdefault(status["phase"], round(time.monotonic() - started, 2))
            if status["status"] != "pending":
                break
            time.sleep(0.02)
        print(json.dumps({
            "chunks": args.chunks, "bytes": args.chunks * config.layout.chunk_bytes,
            "seconds": round(time.monotonic() - started, 2), "phases_first_seen_s": phases,
            "final": status,
        }))  # fmt: skip
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
