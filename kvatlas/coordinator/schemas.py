"""Request bodies of the HTTP API, as pydantic models so that ``/openapi.json`` documents them.

Field names follow LMCache's coordinator where the seeds define them, so LMCache MP servers and
their clients can point at kvatlas unchanged. Unknown fields are ignored (be liberal in what
you accept); semantic validation (hex, salts, token ranges) happens in the handlers with
messages that name the field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field


class WireKey(BaseModel):
    model_config = ConfigDict(extra="ignore")

    chunk_hash_hex: str = Field(description="64 lower- or upper-case hex characters")
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class LookupRequest(BaseModel):
    """Exactly one form: ``keys``, or ``token_ids`` (or ``tokens_b64``) with ``model_name``."""

    model_config = ConfigDict(extra="ignore")

    keys: list[WireKey] | None = None
    token_ids: list[int] | None = None
    tokens_b64: str | None = None
    model_name: str | None = None
    world_size: int = 1
    cache_salt: str = ""
    object_group_id: int = 0


class BlendLookupBody(msgspec.Struct):
    """The hot path's body: decoded by msgspec straight from bytes (no dict, no pydantic)."""

    tokens_b64: Annotated[
        str | None,
        msgspec.Meta(description="base64 of the query token ids as little-endian uint32"),
    ] = None
    token_ids: Annotated[
        list[int] | None, msgspec.Meta(description="alternative to tokens_b64")
    ] = None
    model_name: str | None = None
    world_size: int = 1
    cache_salt: str = ""


BLEND_LOOKUP_BODY_SCHEMA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": msgspec.json.schema_components([BlendLookupBody])[1]["BlendLookupBody"]
            }
        },
    }
}


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instance_id: str | None = None
    ip: str = ""
    http_port: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    p2p_advertised_url: str | None = None
    mq_port: int | None = None


EVENTS_BODY_SCHEMA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["batches"],
                    "properties": {
                        "batches": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": [
                                    "instance_id",
                                    "incarnation",
                                    "seq",
                                    "event_type",
                                    "tier",
                                ],
                                "properties": {
                                    "instance_id": {"type": "string"},
                                    "incarnation": {"type": "integer", "minimum": 0},
                                    "seq": {"type": "integer", "minimum": 1},
                                    "event_type": {
                                        "type": "string",
                                        "enum": ["store", "delete", "access", "config"],
                                    },
                                    "tier": {"type": "string", "enum": ["l1", "l2"]},
                                    "backend": {"type": "string"},
                                    "shared": {"type": "boolean"},
                                    "ts": {"type": "number"},
                                    "capacity_bytes": {"type": "integer", "minimum": 0},
                                    "capacity_revision": {"type": "integer", "minimum": 0},
                                    "entries": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["key"],
                                            "properties": {
                                                "key": WireKey.model_json_schema(),
                                                "size_bytes": {"type": "integer", "minimum": 0},
                                                "token_ids": {
                                                    "type": "array",
                                                    "items": {"type": "integer"},
                                                },
                                                "token_offset": {"type": "integer"},
                                            },
                                        },
                                    },
                                },
                            },
                        }
                    },
                }
            },
            "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
