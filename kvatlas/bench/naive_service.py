"""A naive ingestion service, the reference's design, for ``kvatlas bench service`` to compare
against in the same run: pydantic models per entry, a dict of dicts, tokens as tuples of ints.

Run as ``python -m kvatlas.bench.naive_service PORT``. Not part of the product.
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class _Key(BaseModel):
    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class _Entry(BaseModel):
    key: _Key
    size_bytes: int = 0
    token_ids: list[int] | None = None
    token_offset: int = -1


class _Batch(BaseModel):
    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str = ""
    shared: bool = False
    ts: float = 0.0
    entries: list[_Entry] = []


class _Body(BaseModel):
    batches: list[_Batch]


def create_naive_app() -> FastAPI:
    app = FastAPI()
    placements: dict[tuple[Any, ...], dict[str, Any]] = {}
    bindings: dict[str, tuple[tuple[int, ...], int]] = {}

    @app.post("/events")
    def events(body: _Body) -> dict[str, int]:
        for batch in body.batches:
            for entry in batch.entries:
                k = entry.key
                ident = (k.chunk_hash_hex, k.model_name, k.kv_rank, k.object_group_id, k.cache_salt)
                placements.setdefault(ident, {})[batch.instance_id] = {
                    "tier": batch.tier,
                    "backend": batch.backend,
                    "size": entry.size_bytes,
                }
                if entry.token_ids is not None:
                    bindings[k.chunk_hash_hex] = (tuple(entry.token_ids), entry.token_offset)
        return {"applied": len(body.batches), "duplicates": 0, "stale": 0}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    uvicorn.run(create_naive_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
