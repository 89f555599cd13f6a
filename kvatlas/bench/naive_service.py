"""A naive ingestion service, the reference's design, for ``kvatlas bench service`` to compare
against in the same run: pydantic models per entry, a dict of dicts, tokens as tuples of ints.
Its models are made from the wire's one definition (:data:`kvatlas.api.events.EventsBody`),
so it reads exactly the bodies the coordinator reads (fields, names, defaults).

Run as ``python -m kvatlas.bench.naive_service PORT``. Not part of the product.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import msgspec.inspect as mi
import uvicorn
from fastapi import FastAPI
from pydantic import create_model

from kvatlas.api.events import EventsBody

_SCALARS: dict[type[mi.Type], Any] = {
    mi.StrType: str, mi.IntType: int, mi.FloatType: float, mi.BoolType: bool, mi.NoneType: None,
}  # fmt: skip


def pydantic_of(t: mi.Type) -> Any:
    """The pydantic form of a wire type: a Struct becomes a model of its fields (a field the
    wire leaves unset when absent defaults to ``None``)."""
    if isinstance(t, mi.Metadata):
        return pydantic_of(t.type)
    if isinstance(t, mi.ListType):
        return list[pydantic_of(t.item_type)]  # type: ignore[misc]
    if isinstance(t, mi.UnionType):
        members = [pydantic_of(m) for m in t.types]
        union = members[0]
        for m in members[1:]:
            union = union | m
        return union
    if isinstance(t, mi.StructType):
        fields: dict[str, Any] = {}
        for f in t.fields:
            kind = pydantic_of(f.type)
            if f.required:
                fields[f.name] = (kind, ...)
            elif f.default_factory is list:
                fields[f.name] = (kind, [])
            elif f.default is not msgspec.NODEFAULT and f.default is not msgspec.UNSET:
                fields[f.name] = (kind, f.default)
            else:  # unset when absent, or read raw by the codec: None
                fields[f.name] = (kind | None, None)
        return create_model(t.cls.__name__.partition("[")[0], **fields)
    return _SCALARS[type(t)]


_Body: Any = pydantic_of(mi.type_info(EventsBody))


def create_naive_app() -> FastAPI:
    app = FastAPI()
    placements: dict[tuple[Any, ...], dict[str, Any]] = {}
    bindings: dict[str, tuple[tuple[int, ...], int]] = {}

    @app.post("/events")
    def events(body: _Body) -> dict[str, int]:  # type: ignore[valid-type]
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
