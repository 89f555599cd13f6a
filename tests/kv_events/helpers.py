"""Golden vLLM payloads and a directory fed the way the coordinator feeds it (no ZMQ)."""

from __future__ import annotations

import json
from pathlib import Path

from kvatlas.coordinator.kv_events import Cleared, Rekeyer
from kvatlas.directory import KeyDirectory
from kvatlas.events.vllm_wire import KVEventBatch, decode_batch
from kvatlas.keys import KeyScheme

GOLDEN = Path("/work/shared/wire/vllm-kv-events")
CASES = json.loads((GOLDEN / "index.json").read_text())["cases"]
HASHES = [bytes.fromhex(h) for h in CASES[0]["block_hashes_hex"]]
TOKENS = list(range(1000, 1064))


def golden(name: str) -> bytes:
    return (GOLDEN / f"{name}.msgpack").read_bytes()


def golden_batch(name: str) -> KVEventBatch:
    return decode_batch(golden(name))


def apply(rekeyer: Rekeyer, directory: KeyDirectory, instance: str, model: str,
          batch: KVEventBatch) -> None:  # fmt: skip
    """What the subscriber does with a translated batch."""
    for op in rekeyer.translate(instance, model, batch):
        if isinstance(op, Cleared):
            directory.fence_instance(op.instance_id)
        else:
            directory.consume(op)


def fed(scheme: str = "blake3", chunk_size: int = 32, max_blocks: int = 1000,
        *, blend: bool = False) -> tuple[Rekeyer, KeyDirectory]:  # fmt: skip
    ks = KeyScheme(scheme, chunk_size)
    directory = KeyDirectory(
        chunk_size, enable_blend_lookup=blend,
        hash_chunks=lambda tokens, _size: ks.chunk_hashes(tokens),
    )  # fmt: skip
    return Rekeyer(ks, max_blocks), directory
