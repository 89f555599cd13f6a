"""The compiled entry parser (``_json_entries``: a JSON batch's entries straight into columns)
against the per-entry decoder: entries written every way JSON and the structs allow (any key
order, white space anywhere, optional fields absent or explicit, non-ASCII names, hex digits
of either case, integers up to 18 digits, token ids up to 2**32 - 1) decode to the same
batches, through the compiled pass (not the fallback); the same bodies broken a byte at a
time, or written in a form the parser leaves to the per-entry path, give the same batches or
the same error."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.errors import KvatlasError
from kvatlas.events import decode_json, decode_json_columns, json_codec
from kvatlas.events._cut_types import COLUMNS
from kvatlas.events._json_cut import ENTRY_BYTES, cut_entries
from kvatlas.keys import pack_kv_rank

RANKS = [pack_kv_rank(1, 0, 1, 0), pack_kv_rank(4, 3, 2, 1), pack_kv_rank(8, 7, 1, 0)]
MODELS = ["m", "Llama-3-8B", "模型/β", "x" * 40]
SALTS = ["", "tenant-a", "é", " "]


def _outcome(decode: Any, body: bytes) -> Any:
    try:
        batches = decode(body)
    except KvatlasError as exc:
        return (type(exc), exc.detail, exc.extra)
    if decode is decode_json_columns:
        batches = [cb.batch() for cb in batches]
    return batches


class SlowPathTaken(AssertionError):
    """A body that must take the compiled pass went the slow way."""


@contextmanager
def fast_path_only() -> Iterator[None]:
    """``decode_json_columns`` with its slow path forbidden (``SlowPathTaken`` instead): for
    forms the compiled pass must take."""

    def forbidden(body: bytes | str) -> Any:
        raise SlowPathTaken(body)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json_codec, "_slow_columns", forbidden)
        yield


def _same(body: bytes, *, fast: bool = False) -> None:
    old = _outcome(decode_json, body)
    if fast:
        with fast_path_only():
            new = _outcome(decode_json_columns, body)
    else:
        new = _outcome(decode_json_columns, body)
    assert new == old, body


@st.composite
def entry_st(draw: st.DrawFn) -> dict[str, Any]:
    digest = draw(st.binary(min_size=32, max_size=32)).hex()
    case = draw(st.sampled_from(["lower", "upper", "mixed"]))
    if case == "upper":
        digest = digest.upper()
    elif case == "mixed":
        digest = "".join(c.upper() if i % 3 == 0 else c for i, c in enumerate(digest))
    key: dict[str, Any] = {
        "chunk_hash_hex": digest,
        "model_name": draw(st.sampled_from(MODELS)),
        "kv_rank": draw(st.sampled_from(RANKS)),
    }
    if draw(st.booleans()):
        key["object_group_id"] = draw(st.sampled_from([0, 7, 10**17, 10**18 - 1]))
    if draw(st.booleans()):
        key["cache_salt"] = draw(st.sampled_from(SALTS))
    entry: dict[str, Any] = {"key": key}
    if draw(st.booleans()):
        entry["size_bytes"] = draw(st.sampled_from([0, 1, 1 << 20, 10**18 - 1]))
    if draw(st.booleans()):
        entry["token_ids"] = draw(
            st.none()
            | st.lists(st.integers(0, (1 << 32) - 1), max_size=20)
            | st.lists(st.integers(0, 128_255), min_size=30, max_size=40)
        )
    if draw(st.booleans()):
        entry["token_offset"] = draw(st.sampled_from([-1, 0, 256, 123_456_789]))
    return entry


def _write(v: Any, rnd: random.Random, spaced: bool) -> str:
    """JSON text of ``v``: keys in a random order, random white space where JSON allows."""

    def ws() -> str:
        return rnd.choice(["", "", " ", "\n", "\t", "\r\n  "]) if spaced else ""

    if isinstance(v, dict):
        items = list(v.items())
        rnd.shuffle(items)
        inner = ",".join(
            f"{ws()}{msgspec.json.encode(k).decode()}{ws()}:{ws()}{_write(x, rnd, spaced)}{ws()}"
            for k, x in items
        )
        return "{" + inner + ws() + "}"
    if isinstance(v, list):
        return "[" + ",".join(ws() + _write(x, rnd, spaced) + ws() for x in v) + ws() + "]"
    return msgspec.json.encode(v).decode()


def _body(entries_per_batch: list[list[dict[str, Any]]], rnd: random.Random, spaced: bool) -> bytes:
    batches = [
        {"instance_id": "a", "incarnation": 1, "seq": s + 1, "event_type": "store",
         "tier": "l1", "backend": "dram", "entries": entries}
        for s, entries in enumerate(entries_per_batch)
    ]  # fmt: skip
    return _write({"batches": batches}, rnd, spaced).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.lists(entry_st(), max_size=5), min_size=1, max_size=3),
    st.randoms(use_true_random=False),
    st.booleans(),
)
def test_valid_entries_decode_alike_through_the_compiled_pass(
    batches: list[list[dict[str, Any]]], rnd: random.Random, spaced: bool
) -> None:
    _same(_body(batches, rnd, spaced), fast=True)  # the compiled pass takes every form above


BREAKERS = b'"\\{}[],: 0-+.eE\x00\x1f\x7f\xff\xc3nul'


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.lists(entry_st(), min_size=1, max_size=3), min_size=1, max_size=2),
    st.randoms(use_true_random=False),
    st.data(),
)
def test_bodies_broken_a_byte_at_a_time_decode_alike(
    batches: list[list[dict[str, Any]]], rnd: random.Random, data: st.DataObject
) -> None:
    body = bytearray(_body(batches, rnd, data.draw(st.booleans())))
    start = body.index(b"entries")  # break the entries, where the compiled parser reads
    at = data.draw(st.integers(start, len(body) - 1))
    byte = data.draw(st.sampled_from(BREAKERS))
    how = data.draw(st.sampled_from(["replace", "insert", "delete"]))
    if how == "replace":
        body[at] = byte
    elif how == "insert":
        body[at:at] = bytes([byte])
    else:
        del body[at]
    _same(bytes(body))


ONE = (
    b'{"batches":[{"instance_id":"a","incarnation":1,"seq":1,"event_type":"store","tier":"l1",'
    b'"backend":"dram","entries":[{"key":{"chunk_hash_hex":"' + b"ab" * 32 + b'",'
    b'"model_name":"m","kv_rank":16777472,"object_group_id":0,"cache_salt":""},'
    b'"size_bytes":5,"token_ids":[1,2,3],"token_offset":0}]}]}'
)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"model_name":"m"', b'"model_name":"\\u006d"'),  # an escape: the per-entry path
        (b'"model_name":"m"', b'"model_name":"m\\n"'),
        (b'"model_name":"m"', b'"model_name":"m\x01"'),  # a control character: refused
        (b'"model_name":"m"', b'"model_name":"\xff"'),  # not UTF-8
        (b'"model_name":"m"', b'"model_name":""'),  # empty: refused by the key
        (b'"model_name":"m"', b'"model_name":1'),
        (b'"object_group_id":0', b'"object_group_id":18446744073709551615'),  # 20 digits: u64
        (b'"object_group_id":0', b'"object_group_id":18446744073709551616'),  # past u64
        (b'"object_group_id":0', b'"object_group_id":-1'),
        (b'"size_bytes":5', b'"size_bytes":-5'),
        (b'"size_bytes":5', b'"size_bytes":9223372036854775807'),  # 19 digits: int64 max
        (b'"size_bytes":5', b'"size_bytes":9223372036854775808'),
        (b'"size_bytes":5', b'"size_bytes":5.0'),
        (b'"size_bytes":5', b'"size_bytes":5e0'),
        (b'"size_bytes":5', b'"size_bytes":-0'),
        (b'"size_bytes":5', b'"size_bytes":05'),
        (b'"size_bytes":5', b'"size_bytes":"5"'),
        (b'"size_bytes":5', b'"size_bytes":null'),
        (b'"token_offset":0', b'"token_offset":-2'),
        (b'"token_offset":0', b'"token_offset":-1'),
        (b'"kv_rank":16777472', b'"kv_rank":7'),  # not a packed rank
        (b'"kv_rank":16777472,', b""),  # required
        (b'"token_ids":[1,2,3]', b'"token_ids":[1,2,4294967296]'),
        (b'"token_ids":[1,2,3]', b'"token_ids":{}'),
        (b'"size_bytes":5', b'"size_bytes":5,"note":[1,{"key":2}]'),  # ignored by the struct
        (b'"cache_salt":""', b'"cache_salt":"","extra":1'),  # refused by the key
        (b'"ab', b'"AB'),
        (b'"ab', b'"zz'),
        (b'"ab', b'"abab'),
        (b'[{"key"', b'[1,{"key"'),
        (b"}]}]}", b"},]}]}"),
        (b"}]}]}", b"} ]}]}"),
        (b'"entries":[', b'"entries":[\n'),
    ],
)
def test_each_form_decodes_as_the_per_entry_path(old: bytes, new: bytes) -> None:
    assert old in ONE
    _same(ONE)
    _same(ONE.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"ab', b'"AB'),  # hex digits of either case
        (b'"model_name":"m"', b'"model_name":"\xe6\xa8\xa1\xe5\x9e\x8b"'),  # UTF-8 text
        (b'"object_group_id":0', b'"object_group_id":999999999999999999'),  # 18 digits
        (b'"size_bytes":5', b'"size_bytes":0'),
        (b'"token_offset":0', b'"token_offset":-1'),  # unknown offset
        (b'"token_ids":[1,2,3]', b'"token_ids":[0,4294967295]'),
        (b'"token_ids":[1,2,3]', b'"token_ids":null'),
        (b'"token_ids":[1,2,3]', b'"token_ids":[ ]'),
        (b'"size_bytes":5,', b""),  # optional fields absent
        (b',"object_group_id":0,"cache_salt":""', b""),
        (b'{"key":{', b'{ "key" : { '),  # white space wherever JSON allows
        (b"}]}]}", b"} ]}]}"),
        (b'"entries":[', b'"entries":[\n'),
    ],
)
def test_valid_forms_take_the_compiled_pass(old: bytes, new: bytes) -> None:
    assert old in ONE
    _same(ONE.replace(old, new, 1), fast=True)


def test_the_fast_only_mode_catches_a_wrong_refusal() -> None:
    """Negative control: a compiled pass that gives up on a valid body (here: always) is
    caught by the mode, though the slow path's answer would be the same."""
    _same(ONE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json_codec, "_cut_entries", lambda body: None)
        _same(ONE)  # the slow path's verdict: equal
        with pytest.raises(SlowPathTaken):
            _same(ONE, fast=True)


def test_the_row_bound_takes_a_body_of_the_smallest_entries() -> None:
    """Rows are bounded by the smallest entry the parser takes (``ENTRY_BYTES``): a body made
    of such entries only is still taken (no fallback for want of rows)."""
    entry = b'{"key":{"chunk_hash_hex":"' + b"0" * 64 + b'","model_name":"m","kv_rank":0}}'
    assert len(entry) > ENTRY_BYTES
    head = b'{"batches":[{"instance_id":"a","incarnation":1,"seq":1,"event_type":"store",'
    body = head + b'"tier":"l1","backend":"d","entries":[' + b",".join([entry] * 500) + b"]}]}"
    cut = cut_entries(body)
    assert cut is not None and cut.counts.tolist() == [500]
    _same(body)  # refused (rank 0 is no packed rank), after the cut took every entry
    valid = body.replace(b'"kv_rank":0}', b'"kv_rank":16777472}')
    _same(valid, fast=True)


def test_decoded_columns_keep_no_more_than_their_entries_need() -> None:
    """A body's columns live until the caller applies them (maybe beside other bodies'): they
    hold the ids the entries carry and the entries' integers, not the scanner's worst-case
    buffers (the arena is sized for ids of one digit, the integer
    matrix for the smallest entries: ≈3.6 MB and 1.3 MB for a 1.8 MB body of 1,024 chunks)."""
    rnd = random.Random(7)
    entries = [
        {"key": {"chunk_hash_hex": rnd.randbytes(32).hex(), "model_name": "m",
                 "kv_rank": RANKS[1]},
         "token_ids": [rnd.randrange(128_256) for _ in range(256)], "token_offset": 256 * i}
        for i in range(300)
    ]  # fmt: skip
    body = _body([entries[:100], entries[100:]], rnd, spaced=False)
    with fast_path_only():
        batches = decode_json_columns(body)
    ids = 256 * len(entries)
    for cb in batches:
        cols = cb.columns
        assert cols is not None
        assert cols.tokens.nbytes == 4 * ids  # (the body's ids: 4 bytes each)
        for column in (cols.token_starts, cols.token_lengths):
            owner = column if column.base is None else column.base
            assert owner.nbytes <= COLUMNS * 8 * len(entries), owner.shape
    _same(body, fast=True)
