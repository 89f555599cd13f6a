import contextlib
import json
import random

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.events import (
    CacheEntry,
    EventBatch,
    EventDecodeError,
    decode_json,
    decode_msgpack,
    decode_msgpack_columns,
    encode_json,
    encode_msgpack,
)
from kvatlas.keys import ObjectKey
from tests.events.strategies import batches

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.lists(batches(), max_size=4))
def test_json_round_trip(bs: list[EventBatch]) -> None:
    assert decode_json(encode_json(bs)) == bs


@FAST
@given(st.lists(batches(), max_size=4))
def test_msgpack_round_trip(bs: list[EventBatch]) -> None:
    assert decode_msgpack(encode_msgpack(bs)) == bs


def _sample_batch(ranks: int = 4) -> EventBatch:
    tokens = list(range(256))
    entries = tuple(
        CacheEntry(ObjectKey(bytes([7]) * 32, "m", 4 << 24 | r << 16 | 4 << 8 | r), 10, tokens, 0)
        for r in range(ranks)
    )
    return EventBatch("node-a", 5, 1, "store", "l1", "dram", ts=1.5, entries=entries)


def test_json_field_names_are_lmcache_compatible() -> None:
    doc = json.loads(encode_json([_sample_batch(1)]))
    (b,) = doc["batches"]
    assert set(b) >= {"instance_id", "incarnation", "seq", "event_type", "tier", "backend"}
    assert set(b) >= {"shared", "ts", "entries"}
    (e,) = b["entries"]
    assert set(e) == {"key", "size_bytes", "token_ids", "token_offset"}
    assert e["key"] == _sample_batch(1).entries[0].key.to_wire()


def test_msgpack_sends_each_chunk_content_once_and_shares_the_array() -> None:
    one, four = (len(encode_msgpack([_sample_batch(n)])) for n in (1, 4))
    assert four - one < 4 * 100  # three more entries cost their keys, not 3 KiB of tokens
    decoded = decode_msgpack(encode_msgpack([_sample_batch(4)]))[0]
    arrays = {id(e.token_ids) for e in decoded.entries}
    assert len(arrays) == 1
    assert len(encode_msgpack([_sample_batch(4)])) < len(encode_json([_sample_batch(4)])) / 3


def _json_body(**entry_overrides: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "key": {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": 1 << 24 | 1 << 8},
        "size_bytes": 1,
        "token_ids": [1, 2],
        "token_offset": 0,
    }
    entry.update(entry_overrides)
    good = {"instance_id": "i", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1"}
    good["backend"] = "dram"
    bad = dict(good, entries=[entry, entry, entry, entry])
    bad["entries"][3] = entry  # type: ignore[index]
    return {"batches": [dict(good, entries=[]), bad]}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"key": {"chunk_hash_hex": "xy", "model_name": "m", "kv_rank": 1}}, "key.chunk_hash_hex"),
        (
            {"key": {"chunk_hash_hex": "ab" * 32, "model_name": "a@b", "kv_rank": 16777472}},
            "key.model_name",
        ),
        ({"key": {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": 7}}, "key.kv_rank"),
        ({"key": {"chunk_hash_hex": "ab" * 32, "model_name": "m"}}, "key.kv_rank"),
        (
            {"key": {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": 16777472, "x": 1}},
            "key.x",
        ),
        (
            {
                "key": {
                    "chunk_hash_hex": "ab" * 32,
                    "model_name": "m",
                    "kv_rank": 16777472,
                    "cache_salt": "a/b",
                }
            },
            "key.cache_salt",
        ),
        ({"size_bytes": -5}, "size_bytes"),
        ({"size_bytes": "5"}, "size_bytes"),
        ({"token_ids": [1, -2]}, "token_ids[1]"),
        ({"token_ids": [1, 1 << 32]}, "token_ids[1]"),
        ({"token_offset": -7}, "token_offset"),
    ],
)
def test_malformed_json_names_the_field(override: dict[str, object], field: str) -> None:
    body = _json_body()
    body["batches"][1]["entries"][3] = dict(body["batches"][1]["entries"][3], **override)  # type: ignore[index]
    with pytest.raises(EventDecodeError) as info:
        decode_json(json.dumps(body))
    assert info.value.field == f"batches[1].entries[3].{field}"


@pytest.mark.parametrize("raw", [b"", b"[", b"{}", b'{"batches": 3}', b"\xff\xfe", b"null"])
def test_garbage_json_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_json(raw)


def test_json_batch_level_errors() -> None:
    body = _json_body()
    body["batches"][0]["seq"] = 0  # type: ignore[index]
    with pytest.raises(EventDecodeError) as info:
        decode_json(json.dumps(body))
    assert info.value.field == "batches[0].seq"
    body["batches"][0]["seq"] = 1  # type: ignore[index]
    del body["batches"][1]["tier"]  # type: ignore[attr-defined]
    with pytest.raises(EventDecodeError) as info:
        decode_json(json.dumps(body))
    assert info.value.field == "batches[1].tier"


def test_msgpack_errors_name_entry_fields() -> None:
    good = encode_msgpack([_sample_batch(2)])
    doc = msgspec.msgpack.decode(good)
    doc["batches"][0]["entries"][1][2] = 3  # bad kv_rank
    with pytest.raises(EventDecodeError) as info:
        decode_msgpack(msgspec.msgpack.encode(doc))
    assert info.value.field == "batches[0].entries[1].kv_rank"
    doc = msgspec.msgpack.decode(good)
    doc["batches"][0]["entries"][0][0] = b"short"
    with pytest.raises(EventDecodeError) as info:
        decode_msgpack(msgspec.msgpack.encode(doc))
    assert info.value.field == "batches[0].entries[0].chunk_hash"
    doc = msgspec.msgpack.decode(good)
    doc["batches"][0]["entries"][0][7] = 5
    with pytest.raises(EventDecodeError) as info:
        decode_msgpack(msgspec.msgpack.encode(doc))
    assert info.value.field == "batches[0].entries[0].content"
    doc = msgspec.msgpack.decode(good)
    doc["batches"][0]["contents"][0] = b"abc"
    with pytest.raises(EventDecodeError) as info:
        decode_msgpack(msgspec.msgpack.encode(doc))
    assert info.value.field == "batches[0].contents[0]"
    doc = msgspec.msgpack.decode(good)
    doc["batches"][0]["entries"][0][1] = 5
    with pytest.raises(EventDecodeError) as info:
        decode_msgpack(msgspec.msgpack.encode(doc))
    assert info.value.field == "batches[0].entries[0].model_name"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_msgpack_decoder_fuzz_random_bytes(raw: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_msgpack(raw)


def test_msgpack_decoder_fuzz_mutations() -> None:
    rng = random.Random(1234)
    seeds = [encode_msgpack([_sample_batch(n)]) for n in (1, 3)]
    seeds.append(encode_msgpack([EventBatch("x", 1, 2, "config", "l2", "", False, 0.0, (), 9, 1)]))
    decoded_ok = 0
    for i in range(3000):
        data = bytearray(seeds[i % len(seeds)])
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.5:
                data[pos] = rng.randrange(256)
            elif op < 0.75:
                del data[pos : pos + rng.randint(1, 8)]
            else:
                data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        try:
            out = decode_msgpack(bytes(data))
        except EventDecodeError:
            continue
        decoded_ok += 1
        assert all(isinstance(b, EventBatch) for b in out)
    assert decoded_ok < 3000


def test_msgpack_shaped_like_the_json_body_is_accepted() -> None:
    """Liberal: a producer that msgpack-encodes the JSON body (tokens as a list or as LE uint32
    bytes) is understood; it decodes to the same batches as the JSON form."""
    body = _json_body()
    as_list = msgspec.msgpack.encode(body)
    with_bytes = json.loads(json.dumps(body))
    for batch in with_bytes["batches"]:
        for entry in batch["entries"]:
            if entry.get("token_ids"):
                entry["token_ids"] = np.asarray(entry["token_ids"], dtype="<u4").tobytes()
    expected = decode_json(json.dumps(body))
    assert decode_msgpack(as_list) == expected
    assert decode_msgpack(msgspec.msgpack.encode(with_bytes)) == expected


@pytest.mark.parametrize("n", [0, 1, 256, 4096, 4097])
def test_split_hashes_cuts_32_byte_hashes_in_order(n: int) -> None:
    """The JSON columns' chunk hashes, cut by a cached struct layout (or slices past 4,096)."""
    from kvatlas.events.json_codec import split_hashes

    raw = bytes(range(256)) * (n // 8) + bytes(32 * (n % 8))
    hashes = split_hashes(raw, n)
    assert hashes == [raw[i : i + 32] for i in range(0, 32 * n, 32)]
    assert all(type(h) is bytes for h in hashes)


@pytest.mark.parametrize("ref", [1 << 63, (1 << 64) - 1])
def test_a_content_reference_outside_int64_is_refused_naming_the_field(ref: int) -> None:
    """The column decoder converted every entry's content reference to int64 in one call:
    2^63 raised ``OverflowError`` (a 500 on ``POST /events``) where 2^63 - 1 was refused."""
    doc = msgspec.msgpack.decode(encode_msgpack([_sample_batch(2)]))
    doc["batches"][0]["entries"][1][7] = ref
    raw = msgspec.msgpack.encode(doc)
    for decode in (decode_msgpack, decode_msgpack_columns):
        with pytest.raises(EventDecodeError) as info:
            decode(raw)
        assert info.value.field == "batches[0].entries[1].content"
