"""``POST /events``: cache-event batches from emitters (JSON or msgpack), applied through the
gate; one invalid batch, or one the caller may not post (another instance, a foreign salt, an
unregistered instance with auth on), refuses the whole body and nothing is applied
(``events_ingest.py`` answers it). See docs/coordinator.md and docs/security.md.

The body is decoded by :mod:`kvatlas.events` (columns, not Structs); :data:`EVENTS_DOCS`
documents it from the event model itself (field names, which are required, types,
enumerations, limits), so the documentation cannot drift from what the decoder accepts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Awaitable
from typing import Any

import msgspec
import numpy as np

from kvatlas.api import KeyRow
from kvatlas.coordinator.routes.context import Context
from kvatlas.events import EVENT_TYPES, INT_BOUNDS, MAX_ID_CHARS, TIERS, EventBatch
from kvatlas.keys import ObjectKey
from kvatlas.routing import Call, Reply


def post_events(ctx: Context, call: Call[None, None]) -> Awaitable[Reply]:
    return ctx.events.handle(call)


def post_events_in_turn(ctx: Context, call: Call[None, None]) -> Reply | None:
    return ctx.events.in_turn(call)


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", bool: "boolean", float: "number"}
_ENUMS: dict[str, frozenset[str]] = {"event_type": EVENT_TYPES, "tier": TIERS}
_MAX_CHARS = {"instance_id": MAX_ID_CHARS, "backend": MAX_ID_CHARS}


def _field_schema(name: str, hint: Any) -> dict[str, Any]:
    args = typing.get_args(hint)
    if types.NoneType in args:  # Optional[X]: absent and null mean the same on the wire
        (hint,) = (a for a in args if a is not types.NoneType)
    if hint is ObjectKey:
        schema: dict[str, Any] = msgspec.json.schema(KeyRow)
        return schema["$defs"]["KeyRow"]  # type: ignore[no-any-return]
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


EVENTS_DOCS: dict[str, Any] = {
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
"""``POST /events``'s request body in ``/openapi.json``."""
