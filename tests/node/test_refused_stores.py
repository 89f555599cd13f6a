"""A chunk L1 refuses (L1 full of held or pinned chunks: the documented refusal, counted
``l1_refused_pinned``) with ``--l2-write evict``: it leaves L1 at once, so it goes to the L2 as
an evicted chunk does (it was dropped, and the store reply still counted it as stored: the
engine was told its KV was cached where no tier held it). ``through``: the control, as before.
Without an L2 the reply says fewer were stored, and why."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.client import EngineClient
from kvatlas.processes import spawn_service, stop

CHUNK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the toy layout, float32: 8 KiB a chunk


@contextmanager
def held_l1(*l2_flags: str) -> Iterator[tuple[EngineClient, list[np.ndarray]]]:
    """A node whose L1 (two chunks) is all held by a move's hold, and the KV of a second
    document's two chunks to store."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn_service([
        "-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "n1",
        "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
        "--chunk-size", "16", "--dtype", "float32", *l2_flags,
        "--l1-bytes", str(2 * CHUNK_BYTES), "--log-level", "warning",
    ], url)  # fmt: skip
    try:
        with EngineClient(url) as engine:
            rng = np.random.default_rng(0)
            doc = np.arange(1000, 1032, dtype=np.uint32)
            engine.store(doc, [rng.standard_normal(engine.layout.shape).astype(np.float32)
                               for _ in range(2)])  # fmt: skip
            hold = {"model_name": "toy", "world_size": 1, "token_ids": doc.tolist(),
                    "source_instance_id": "n1"}  # fmt: skip
            reply = httpx.put(f"{url}/cache/holds/h1", json=hold)  # L1 is now all held
            assert reply.status_code == 200 and len(reply.json()["held"]) == 2
            yield engine, [rng.standard_normal(engine.layout.shape).astype(np.float32)
                           for _ in range(2)]  # fmt: skip
    finally:
        stop([proc])


OTHER = np.arange(2000, 2032, dtype=np.uint32)


@pytest.mark.parametrize("l2_write", ["through", "evict"])
def test_a_chunk_l1_refuses_goes_to_the_l2_in_either_write_mode(
    tmp_path: Path, l2_write: str
) -> None:
    with held_l1("--l2", "fs", "--l2-path", str(tmp_path), "--l2-write", l2_write) as (engine, kv):
        stored = engine.store(OTHER, kv)
        assert stored == 2  # to the L2, whichever the write mode
        chunks, _ = engine.retrieve(OTHER)
        assert engine.stats().get("l1_refused_pinned") == 2  # the documented refusal
        assert len(chunks) == stored, f"stored={stored} but {len(chunks)} retrievable"
        assert all(np.array_equal(a, b) for a, b in zip(chunks, kv, strict=True))


def test_without_an_l2_a_refused_chunk_is_not_counted_stored() -> None:
    with held_l1("--l2", "none") as (engine, kv):
        assert engine.store(OTHER, kv) == 0
        assert engine.stats().get("l1_refused_pinned") == 2
