"""The event batch's wire is written once (:mod:`kvatlas.api.events`): both codecs decode with
those types and encode from them, and the naive reference service's pydantic models are made
from them, so no second statement of a field can drift."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest

from kvatlas.api.events import (
    EventsBody,
    EventsBodyOf,
    PackedEventsBody,
)
from kvatlas.bench.naive_service import _Body as NaiveBody
from kvatlas.events import (
    CacheEntry,
    EventBatch,
    EventDecodeError,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    json_codec,
    msgpack_codec,
)
from kvatlas.keys import ObjectKey, pack_kv_rank

RANK = pack_kv_rank(2, 1, 1, 0)
TOKENS = np.arange(8, dtype=np.uint32)


def batches() -> list[EventBatch]:
    key = ObjectKey(bytes(range(32)), "m", RANK, 3, "salt")
    return [
        EventBatch("n1", 1, 1, "store", "l1", "dram", entries=(CacheEntry(key, 64, TOKENS, 16),)),
        EventBatch("n1", 1, 2, "config", "l1", "dram", capacity_bytes=10, capacity_revision=2),
        EventBatch("n1", 1, 3, "resync", "l1", "dram", prefixes=("00",), dropped_events=4),
        EventBatch("n1", 1, 4, "delete", "l1", "dram", entries=(CacheEntry(key),)),
    ]


def _shape(t: mi.Type) -> Any:
    """A type's fields, names, requiredness and defaults, with the token list's own type
    (``Raw`` in the decoder, a list in the contract) left out."""
    if isinstance(t, mi.StructType):
        return [
            (f.name, f.required, repr(f.default), _shape(f.type))
            for f in t.fields
            if f.name != "token_ids"
        ]
    if isinstance(t, mi.ListType):
        return ["list", _shape(t.item_type)]
    if isinstance(t, mi.UnionType):
        return ["union", *(_shape(m) for m in t.types)]
    return type(t).__name__


def test_the_json_decoder_is_the_contract_with_raw_token_lists() -> None:
    """The codec's decoder type is the contract's one definition, parametrized: same fields,
    names, defaults, and the key still refuses unknown fields."""
    assert json_codec._WireBody == EventsBodyOf[msgspec.Raw]
    assert _shape(mi.type_info(json_codec._WireBody)) == _shape(mi.type_info(EventsBody))
    assert msgpack_codec._decoder.type is PackedEventsBody


def test_encoders_write_the_contract_and_decoders_read_it_back() -> None:
    sent = batches()
    body = encode_json(sent)
    contract = msgspec.json.decode(body, type=EventsBody)  # the contract reads what we send
    assert [b.batches[0].entries[0].token_ids for b in [contract]] == [TOKENS.tolist()]
    assert decode_json(body) == sent
    packed = encode_msgpack(sent)
    assert msgspec.msgpack.decode(packed, type=PackedEventsBody).v == 1
    assert decode_msgpack(packed) == sent
    # what says nothing is not sent: no capacity on a store batch, no dropped count of 0
    first = msgspec.json.decode(body)["batches"][0]
    assert not {"capacity_bytes", "capacity_revision", "dropped_events", "prefixes"} & set(first)


def test_the_json_schema_states_uint32_token_lists() -> None:
    schema = msgspec.json.schema(EventsBody)
    entry = next(v for k, v in schema["$defs"].items() if k.startswith("EventEntry"))
    tokens = entry["properties"]["token_ids"]["anyOf"][0]["items"]
    assert tokens == {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}


def test_a_null_backend_reads_as_empty_in_both_codecs() -> None:
    """One header for both forms: a ``null`` backend (LMCache's pydantic default) is ``""``
    in the compact form too; a store batch still needs one."""
    body: dict[str, Any] = {
        "batches": [
            {"instance_id": "n", "incarnation": 1, "seq": 1, "event_type": "access",
             "tier": "l1", "backend": None}
        ]
    }  # fmt: skip
    assert decode_json(msgspec.json.encode(body))[0].backend == ""
    assert decode_msgpack(msgspec.msgpack.encode(body))[0].backend == ""
    body["batches"][0]["event_type"] = "store"
    for decode, encode in (
        (decode_json, msgspec.json.encode),
        (decode_msgpack, msgspec.msgpack.encode),
    ):
        with pytest.raises(EventDecodeError, match="backend"):
            decode(encode(body))


def test_the_naive_service_reads_the_same_fields() -> None:
    """The benchmark's reference service is generated from the one definition."""

    def fields(model: Any) -> Any:
        out = {}
        for name, f in model.model_fields.items():
            out[name] = f.is_required()
            inner = getattr(f.annotation, "__args__", ())
            for arg in (f.annotation, *inner):
                if hasattr(arg, "model_fields"):
                    out[name] = fields(arg)
        return out

    def struct_fields(t: mi.Type) -> Any:
        out: dict[str, Any] = {}
        for f in t.fields:  # type: ignore[attr-defined]
            out[f.name] = f.required
            inner = f.type.item_type if isinstance(f.type, mi.ListType) else f.type
            if isinstance(inner, mi.StructType):
                out[f.name] = struct_fields(inner)
        return out

    assert fields(NaiveBody) == struct_fields(mi.type_info(EventsBody))
