"""The ``POST /events`` body schema in ``/openapi.json`` is generated from the event model:
its enumerations are the model's constants, its fields the model's fields, and its bounds are
exactly where the model starts refusing values."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvatlas.coordinator.routes.events import EVENTS_DOCS as EVENTS_BODY_SCHEMA
from kvatlas.events import (
    EVENT_TYPES,
    TIERS,
    CacheEntry,
    EventBatch,
    EventValidationError,
)
from kvatlas.keys import ObjectKey

_BODY = EVENTS_BODY_SCHEMA["requestBody"]["content"]["application/json"]["schema"]
BATCH = _BODY["properties"]["batches"]["items"]
ENTRY = BATCH["properties"]["entries"]["items"]
KEY = ObjectKey(b"\x00" * 32, "m", 1 << 24 | 1 << 8)


def test_enums_are_the_model_constants() -> None:
    assert set(BATCH["properties"]["event_type"]["enum"]) == EVENT_TYPES
    assert set(BATCH["properties"]["tier"]["enum"]) == TIERS


def test_fields_and_required_are_the_model_fields() -> None:
    for schema, model in ((BATCH, EventBatch), (ENTRY, CacheEntry)):
        fields = dataclasses.fields(model)
        assert list(schema["properties"]) == [f.name for f in fields]
        assert schema["required"] == [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
    assert set(ENTRY["properties"]["key"]["properties"]) == set(KEY.to_wire())


def _batch(**fields: Any) -> EventBatch:
    base: dict[str, Any] = {
        "instance_id": "a",
        "incarnation": 1,
        "seq": 1,
        "event_type": "store",
        "tier": "l1",
        "backend": "dram",
    }
    if "capacity_bytes" in fields or "capacity_revision" in fields:
        base.update(event_type="config", capacity_bytes=0, capacity_revision=0)
    return EventBatch(**{**base, **fields})


def _entry(**fields: Any) -> CacheEntry:
    return CacheEntry(KEY, **fields)


@pytest.mark.parametrize(
    ("schema", "build", "name"),
    [
        (BATCH, _batch, "incarnation"),
        (BATCH, _batch, "seq"),
        (BATCH, _batch, "capacity_bytes"),
        (BATCH, _batch, "capacity_revision"),
        (ENTRY, _entry, "size_bytes"),
        (ENTRY, _entry, "token_offset"),
    ],
)
def test_integer_bounds_are_where_the_model_refuses(schema: Any, build: Any, name: str) -> None:
    lo, hi = schema["properties"][name]["minimum"], schema["properties"][name]["maximum"]
    build(**{name: lo})
    build(**{name: hi})
    for outside in (lo - 1, hi + 1):
        with pytest.raises(EventValidationError):
            build(**{name: outside})


@pytest.mark.parametrize("name", ["instance_id", "backend"])
def test_string_lengths_are_where_the_model_refuses(name: str) -> None:
    most = BATCH["properties"][name]["maxLength"]
    _batch(**{name: "x" * most})
    with pytest.raises(EventValidationError):
        _batch(**{name: "x" * (most + 1)})


def test_msgpack_body_documented() -> None:
    content = EVENTS_BODY_SCHEMA["requestBody"]["content"]
    assert content["application/msgpack"] == {"schema": {"type": "string", "format": "binary"}}
