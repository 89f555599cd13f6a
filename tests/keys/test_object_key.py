"""ObjectKey, kv_rank packing, namespaces, wire form and prefix expansion."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.keys import (
    BlendNamespace,
    ObjectKey,
    expand_prefix_keys,
    object_keys,
    pack_kv_rank,
    parse_chunk_hash_hex,
    unpack_kv_rank,
)

H = bytes(range(32))


def test_pack_layout() -> None:
    assert pack_kv_rank(4, 2, 2, 0) == 4 << 24 | 2 << 16 | 2 << 8 | 0
    assert pack_kv_rank(1, 0, 1, 0) == 0x01000100


@given(st.data())
def test_pack_unpack_round_trip(data: st.DataObject) -> None:
    ws = data.draw(st.integers(1, 255))
    lws = data.draw(st.integers(1, 255))
    fields = (ws, data.draw(st.integers(0, ws - 1)), lws, data.draw(st.integers(0, lws - 1)))
    assert unpack_kv_rank(pack_kv_rank(*fields)) == fields


@pytest.mark.parametrize(
    "fields",
    [
        (0, 0, 1, 0),
        (256, 0, 1, 0),
        (2, 2, 1, 0),
        (2, -1, 1, 0),
        (2, 0, 0, 0),
        (2, 0, 2, 2),
        (True, 0, 1, 0),
    ],
)
def test_pack_validation(fields: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        pack_kv_rank(*fields)


@pytest.mark.parametrize("kv_rank", [0, -1, 1 << 32, 0x02030100])
def test_unpack_validation(kv_rank: int) -> None:
    with pytest.raises(ValueError):
        unpack_kv_rank(kv_rank)


def test_object_key_is_hashable_and_immutable() -> None:
    key = ObjectKey(H, "llama", pack_kv_rank(2, 1, 2, 1), 0, "tenant")
    assert {key: 1}[ObjectKey(H, "llama", pack_kv_rank(2, 1, 2, 1), 0, "tenant")] == 1
    with pytest.raises(AttributeError):
        key.model_name = "other"  # type: ignore[misc]
    assert key.world_size == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_hash": b"short"},
        {"model_name": ""},
        {"model_name": "a@b"},
        {"cache_salt": "x" * 129},
        {"cache_salt": "a/b"},
        {"cache_salt": "a\\b"},
        {"cache_salt": "a@b"},
        {"cache_salt": "a\x00b"},
        {"object_group_id": -1},
        {"object_group_id": 1 << 64},  # (an event's group id is a u64: refused there too)
        {"kv_rank": 0},
    ],
)
def test_object_key_validation(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "chunk_hash": H,
        "model_name": "m",
        "kv_rank": pack_kv_rank(1, 0, 1, 0),
    }
    with pytest.raises(ValueError):
        ObjectKey(**(base | kwargs))  # type: ignore[arg-type]


def test_salt_of_128_chars_is_fine() -> None:
    ObjectKey(H, "m", pack_kv_rank(1, 0, 1, 0), cache_salt="s" * 128)


def test_wire_round_trip_through_json() -> None:
    key = ObjectKey(H, "org/model", pack_kv_rank(8, 3, 4, 3), 2, "salt")
    wire = json.loads(json.dumps(key.to_wire()))
    assert wire == {
        "chunk_hash_hex": H.hex(),
        "model_name": "org/model",
        "kv_rank": pack_kv_rank(8, 3, 4, 3),
        "object_group_id": 2,
        "cache_salt": "salt",
    }
    assert ObjectKey.from_wire(wire) == key


def test_wire_defaults_and_upper_case_hex() -> None:
    key = ObjectKey.from_wire(
        {"chunk_hash_hex": H.hex().upper(), "model_name": "m", "kv_rank": 16777472}
    )
    assert key.chunk_hash == H and key.object_group_id == 0 and key.cache_salt == ""


@pytest.mark.parametrize(
    "wire",
    [
        {"chunk_hash_hex": "ab" * 31, "model_name": "m", "kv_rank": 16777472},
        {"chunk_hash_hex": "zz" * 32, "model_name": "m", "kv_rank": 16777472},
        {"chunk_hash_hex": 5, "model_name": "m", "kv_rank": 16777472},
        {"model_name": "m", "kv_rank": 16777472},
        {"chunk_hash_hex": "ab" * 32, "kv_rank": 16777472},
        {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": "1"},
        {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": 16777472, "extra": 1},
        [],
    ],
)
def test_wire_rejects_bad_keys(wire: object) -> None:
    with pytest.raises(ValueError):
        ObjectKey.from_wire(wire)  # type: ignore[arg-type]


def test_parse_chunk_hash_hex() -> None:
    assert parse_chunk_hash_hex("00" * 32) == bytes(32)
    with pytest.raises(ValueError, match="64 hex"):
        parse_chunk_hash_hex("0x" + "0" * 62)


def test_namespace_from_object_key_ignores_group() -> None:
    a = ObjectKey(H, "m", pack_kv_rank(4, 1, 4, 1), 0, "s")
    b = ObjectKey(H, "m", pack_kv_rank(4, 3, 2, 1), 7, "s")
    assert (
        BlendNamespace.from_object_key(a)
        == BlendNamespace.from_object_key(b)
        == BlendNamespace("m", "s", 4)
    )


@pytest.mark.parametrize(
    "kwargs", [{"model_name": "a@b"}, {"cache_salt": "/"}, {"world_size": 0}, {"world_size": 256}]
)
def test_namespace_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        BlendNamespace(**({"model_name": "m"} | kwargs))  # type: ignore[arg-type]


def test_prefix_expansion_is_chunk_major_rank_minor() -> None:
    hashes = [bytes([1]) * 32, bytes([2]) * 32]
    keys = expand_prefix_keys(hashes, "m", world_size=2, cache_salt="s")
    assert [(k.chunk_hash[0], k.kv_rank) for k in keys] == [
        (1, pack_kv_rank(2, 0, 2, 0)),
        (1, pack_kv_rank(2, 1, 2, 1)),
        (2, pack_kv_rank(2, 0, 2, 0)),
        (2, pack_kv_rank(2, 1, 2, 1)),
    ]
    assert {k.cache_salt for k in keys} == {"s"}
    assert len(expand_prefix_keys(hashes, "m")) == 2


_GOOD_HEX = st.binary(min_size=32, max_size=32).flatmap(
    lambda b: st.sampled_from([b.hex(), b.hex().upper()])
)
_ODD_HEX = st.one_of(
    st.text(max_size=70),  # anything, mostly not 64 hex characters
    _GOOD_HEX.map(lambda h: h[:10] + "  " + h[12:]),  # white space, still 64 characters
    _GOOD_HEX.map(lambda h: h[:-2] + "\u0663\u0663"),  # non-ASCII digits
    _GOOD_HEX.map(lambda h: h[:63]),
)
_RANK = pack_kv_rank(1, 0, 1, 0)
_PARTS = st.one_of(
    st.just(("m", _RANK, 0, "")),
    st.just(("other/model", pack_kv_rank(2, 1, 2, 1), 7, "tenant")),
    st.tuples(
        st.sampled_from(["m", "", "a@b", "x" * 300]),
        st.sampled_from([_RANK, 0, -1, 1 << 40, True]),
        st.sampled_from([0, -1, 1 << 70, False]),
        st.sampled_from(["", "s", "a/b", "\x00"]),
    ),
)


def _one_by_one(hexes: list[str], parts: list[tuple[object, ...]]) -> list[ObjectKey] | str:
    try:
        return [ObjectKey(parse_chunk_hash_hex(h), *p) for h, p in zip(hexes, parts, strict=True)]  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.tuples(st.one_of(_GOOD_HEX, _GOOD_HEX, _GOOD_HEX, _ODD_HEX), _PARTS), max_size=12)
)
def test_keys_built_together_equal_keys_built_one_by_one(
    rows: list[tuple[str, tuple[object, ...]]],
) -> None:
    """The same keys (equal, same hash, same fields), or the same error for the first key that
    breaks a rule: hashes not hex, of another length, with white space or other digits; model
    names, ranks, groups and salts out of their rules, ``True`` for an int."""
    hexes, parts = [h for h, _ in rows], [p for _, p in rows]
    try:
        built: list[ObjectKey] | str = object_keys(hexes, parts)  # type: ignore[arg-type]
    except ValueError as exc:
        built = str(exc)
    expected = _one_by_one(hexes, parts)
    assert built == expected
    if isinstance(built, list):
        assert [hash(k) for k in built] == [hash(k) for k in expected]  # type: ignore[union-attr]
        assert all(type(k.kv_rank) is int for k in built)
