"""Request bodies of the HTTP API, as the models that ``/openapi.json`` documents.

Field names follow LMCache's coordinator, so LMCache MP servers and their clients can point at
kvatlas unchanged. Unknown fields are ignored (be liberal in what you accept); semantic
validation (hex, salts, token ranges) happens in ``query.py`` with messages that name the
field. The events body is documented from the event model itself (``EVENTS_BODY_SCHEMA``).
See docs/coordinator.md ("API").
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvatlas.api import BlendLookupBody, RouteScoreBody
from kvatlas.events import (
    EVENT_TYPES,
    INT_BOUNDS,
    MAX_ID_CHARS,
    TIERS,
    EventBatch,
)
from kvatlas.keys import ObjectKey


class WireKey(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # "12" is not a number (one rule)

    chunk_hash_hex: str = Field(description="64 lower- or upper-case hex characters")
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class LookupRequest(BaseModel):
    """Exactly one form: ``keys``, or ``token_ids`` (or ``tokens_b64``) with ``model_name``.
    Strict, as the blend lookup's msgspec decoding: ``"12"`` is not a token id."""

    model_config = ConfigDict(extra="ignore", strict=True)

    keys: list[WireKey] | None = None
    token_ids: list[int] | None = None
    tokens_b64: str | None = None
    model_name: str | None = None
    world_size: int = 1
    cache_salt: str = ""
    object_group_id: int = 0


def _inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic schema with its ``$defs`` references replaced by the definitions (a request
    body documented through ``openapi_extra`` has no components to refer to)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    inlined: dict[str, Any] = walk(schema)
    return inlined


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """An ``openapi_extra`` that documents a required JSON request body of ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _struct_schema(type_: type[msgspec.Struct]) -> dict[str, Any]:
    """The JSON schema of a wire type of :mod:`kvatlas.api`: the decoder's own description."""
    schema: dict[str, Any] = msgspec.json.schema_components([type_])[1][type_.__name__]
    return schema


LOOKUP_BODY_SCHEMA = _json_body(_inline_defs(LookupRequest.model_json_schema()))
"""``POST /directory/lookup``'s body, documented here because the route parses it itself (on a
worker thread: a lookup body may be large)."""

BLEND_LOOKUP_BODY_SCHEMA = _json_body(_struct_schema(BlendLookupBody)) | {
    "parameters": [
        {
            "name": "with_placements",
            "in": "query",
            "required": False,
            "description": "true: each match lists the instances holding it (`placements`)",
            "schema": {"type": "boolean", "default": False},
        }
    ],
}

ROUTE_SCORE_BODY_SCHEMA = _json_body(_struct_schema(RouteScoreBody))


class RegisterRequest(BaseModel):
    """LMCache's defaults mean "absent": ``instance_id: ""`` (the coordinator assigns one),
    ``p2p_advertised_url: ""``, ``mq_port: 0``, ``chunk_size: null``."""

    model_config = ConfigDict(extra="ignore")

    instance_id: str | None = None
    ip: str = ""
    http_port: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    p2p_advertised_url: str | None = None
    mq_port: int | None = None
    chunk_size: int | None = Field(None, description="the instance's chunk size (409 if not ours)")
    p2p_url_signature: str | None = Field(
        None, description="kvatlas nodes: their peer secret's signature of id and URL (hex)"
    )
    engine_id: str | None = Field(
        None,
        description="kvatlas nodes: the engine whose KV connector this node is (its copies "
        "count as that engine's own in POST /route/score)",
    )


class ChunkSizeRequest(BaseModel):
    """``PUT /config/chunk-size`` (LMCache 0.5.7): the chunk size an instance runs with."""

    model_config = ConfigDict(extra="ignore")

    chunk_size: int


# ---------------------------------------------------------------------------- POST /events
# The body is decoded by kvatlas.events (msgspec, not pydantic); its schema is generated from
# the event model itself (field names, which are required, types, enumerations, limits), so
# the documentation cannot drift from what the decoder accepts.

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", bool: "boolean", float: "number"}
_ENUMS: dict[str, frozenset[str]] = {"event_type": EVENT_TYPES, "tier": TIERS}
_MAX_CHARS = {"instance_id": MAX_ID_CHARS, "backend": MAX_ID_CHARS}


def _field_schema(name: str, hint: Any) -> dict[str, Any]:
    args = typing.get_args(hint)
    if types.NoneType in args:  # Optional[X]: absent and null mean the same on the wire
        (hint,) = (a for a in args if a is not types.NoneType)
    if hint is ObjectKey:
        return WireKey.model_json_schema()
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is str:  # resync prefixes
        return {"type": "array", "items": {"type": "string", "pattern": "^([0-9a-fA-F]{2}){1,2}$"}}
    if typing.get_origin(hint) is tuple:  # the batch's entries
        return {"type": "array", "items": _object_schema(typing.get_args(hint)[0])}
    if typing.get_origin(hint) is np.ndarray:  # token ids
        return {"type": "array", "items": {"type": "integer"}}
    out: dict[str, Any] = {"type": _JSON_TYPES[hint]}
    if name in _ENUMS:
        out["enum"] = sorted(_ENUMS[name])
    if name in INT_BOUNDS:
        out["minimum"], out["maximum"] = INT_BOUNDS[name]
    if name in _MAX_CHARS:
        out["maxLength"] = _MAX_CHARS[name]
    return out


def _object_schema(model: type) -> dict[str, Any]:
    """A dataclass of the event model as a JSON object: its fields, required if no default."""
    hints = typing.get_type_hints(model)
    fields = dataclasses.fields(model)
    return {
        "type": "object",
        "required": [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ],
        "properties": {f.name: _field_schema(f.name, hints[f.name]) for f in fields},
    }


EVENTS_BODY_SCHEMA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["batches"],
                    "properties": {
                        "batches": {"type": "array", "items": _object_schema(EventBatch)}
                    },
                }
            },
            "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
