"""Error paths: every bad input is a 4xx with a JSON ``detail``, and a rejected event body
changes nothing (coordinator.md §2, §4; directory.md §2 "applied entirely or not at all")."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import pytest

from kvatlas.coordinator.server import BackgroundServer
from kvatlas.events import CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey
from tests.coordinator.helpers import (
    CS,
    RANK1,
    Emitter,
    assert_error,
    b64,
    fresh,
    fresh_tokens,
    lookup_tokens,
    post_batches,
    running,
    stats,
    wire_batch,
    wire_entry,
    wire_key,
)

MAX_BODY = 4096
MAX_TOKENS = 16
MAX_ENTRIES = 8
HEX63 = "a" * 63


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    with running(
        max_body_bytes=MAX_BODY, max_query_tokens=MAX_TOKENS, max_batch_entries=MAX_ENTRIES
    ) as pair:
        yield pair


def _state(client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = client.get("/instances").json()["instances"]
    cursors = {r["instance_id"]: (r["incarnation"], r["last_seq"], r["gaps"]) for r in rows}
    return stats(client), cursors


@contextmanager
def nothing_applied(client: httpx.Client) -> Iterator[None]:
    """The directory (stats) and every emitter cursor are the same before and after."""
    before = _state(client)
    yield
    assert _state(client) == before
    assert client.get("/healthz").status_code == 200  # and the service keeps serving


# ------------------------------------------------------------------------------- blend lookup


def _blend(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/directory/blend-lookup", json=body)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tokens_b64": "!!!not base64!!!", "model_name": "m"}, "base64"),
        ({"tokens_b64": "AAAA=AAA", "model_name": "m"}, "base64"),
        ({"tokens_b64": "é", "model_name": "m"}, "base64"),
        ({"tokens_b64": base64.b64encode(b"123456").decode(), "model_name": "m"}, "multiple of 4"),
        ({"tokens_b64": b64([1, 2, 3, 4])}, "model_name"),
        ({"token_ids": [1, 2, 3, 4]}, "model_name"),
        ({"token_ids": [1, 2**32], "model_name": "m"}, "token"),
        ({"token_ids": [-1], "model_name": "m"}, "token"),
        ({"token_ids": [1], "tokens_b64": b64([1]), "model_name": "m"}, "not both"),
        ({"tokens_b64": b64([1] * 4), "model_name": "m@x"}, "@"),
        ({"tokens_b64": b64([1] * 4), "model_name": "m", "cache_salt": "a/b"}, "cache_salt"),
        ({"tokens_b64": b64([1] * 4), "model_name": "m", "world_size": 0}, "world_size"),
        ({"tokens_b64": b64([1] * 4), "model_name": "m", "world_size": 256}, "world_size"),
        ({"tokens_b64": 5, "model_name": "m"}, "tokens_b64"),
        ({"token_ids": "abc", "model_name": "m"}, "token_ids"),
        ({"token_ids": [1.5], "model_name": "m"}, "token_ids"),
    ],
)
def test_blend_lookup_bad_input(client: httpx.Client, body: dict[str, Any], needle: str) -> None:
    detail = assert_error(_blend(client, **body), 422)["detail"]
    assert needle in detail, detail


@pytest.mark.parametrize("form", ["tokens_b64", "token_ids"])
def test_blend_lookup_too_many_tokens(
    limited: tuple[BackgroundServer, httpx.Client], form: str
) -> None:
    _, client = limited
    tokens = list(range(MAX_TOKENS + 1))
    value: Any = b64(tokens) if form == "tokens_b64" else tokens
    assert (
        "max-query-tokens"
        in assert_error(_blend(client, model_name="m", **{form: value}), 413)["detail"]
    )
    ok: Any = b64(tokens[:-1]) if form == "tokens_b64" else tokens[:-1]
    assert _blend(client, model_name="m", **{form: ok}).status_code == 200


# ------------------------------------------------------------------------------------- lookup


def _lookup(client: httpx.Client, body: Any) -> httpx.Response:
    return client.post("/directory/lookup", json=body)


GOOD_KEY = wire_key(b"\x01" * 32)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"keys": [GOOD_KEY], "token_ids": [1, 2, 3, 4], "model_name": "m"}, "exactly one"),
        ({"keys": [GOOD_KEY], "tokens_b64": b64([1]), "model_name": "m"}, "exactly one"),
        ({}, "exactly one"),
        ({"model_name": "m"}, "exactly one"),
        ({"token_ids": [1, 2, 3, 4]}, "model_name"),
        ({"token_ids": [1, 2, 3, 4], "model_name": ""}, "model_name"),
        ({"token_ids": [0, 2**32], "model_name": "m"}, "2**32"),
        ({"token_ids": [2**70], "model_name": "m"}, "token"),
        ({"token_ids": [-5], "model_name": "m"}, "token"),
        ({"token_ids": [1], "tokens_b64": b64([1]), "model_name": "m"}, "not both"),
        ({"tokens_b64": "%%%", "model_name": "m"}, "base64"),
        ({"tokens_b64": "AAAAAAAA", "model_name": "m"}, "multiple of 4"),
        ({"token_ids": [1, 2, 3, 4], "model_name": "a@b"}, "@"),
        ({"token_ids": [1, 2, 3, 4], "model_name": "m", "cache_salt": "x/y"}, "cache_salt"),
        ({"token_ids": [1, 2, 3, 4], "model_name": "m", "world_size": 0}, "world_size"),
        ({"token_ids": [1, 2, 3, 4], "model_name": "m", "object_group_id": -1}, "object_group"),
        ({"keys": [{**GOOD_KEY, "chunk_hash_hex": HEX63}]}, "64 hex"),
        ({"keys": [{**GOOD_KEY, "chunk_hash_hex": "g" * 64}]}, "64 hex"),
        ({"keys": [{**GOOD_KEY, "cache_salt": "bad/salt"}]}, "cache_salt"),
        ({"keys": [{**GOOD_KEY, "cache_salt": "bad@salt"}]}, "cache_salt"),
        ({"keys": [{**GOOD_KEY, "model_name": "model@x"}]}, "@"),
        ({"keys": [{**GOOD_KEY, "model_name": ""}]}, "model_name"),
        ({"keys": [{**GOOD_KEY, "kv_rank": 0}]}, "world_size"),
        ({"keys": [{**GOOD_KEY, "kv_rank": 2**40}]}, "kv_rank"),
        ({"keys": [{**GOOD_KEY, "kv_rank": -1}]}, "kv_rank"),
        ({"keys": [{**GOOD_KEY, "object_group_id": -1}]}, "object_group_id"),
        ({"keys": [{"model_name": "m", "kv_rank": RANK1}]}, "chunk_hash_hex"),
        ({"keys": ["not an object"]}, "keys"),
        ({"keys": "nope"}, "keys"),
        ({"token_ids": "abc", "model_name": "m"}, "token_ids"),
        ({"token_ids": [1, 2, 3, 4], "model_name": "m", "world_size": "two"}, "world_size"),
        (["token_ids"], ""),
    ],
)
def test_lookup_bad_input(client: httpx.Client, body: Any, needle: str) -> None:
    detail = assert_error(_lookup(client, body), 422)["detail"]
    assert needle in detail, detail


def test_lookup_too_many_tokens_and_keys(limited: tuple[BackgroundServer, httpx.Client]) -> None:
    _, client = limited
    tokens = list(range(MAX_TOKENS + 1))
    assert_error(_lookup(client, {"token_ids": tokens, "model_name": "m"}), 413)
    assert_error(_lookup(client, {"tokens_b64": b64(tokens), "model_name": "m"}), 413)
    keys = [wire_key(bytes([i]) * 32) for i in range(MAX_TOKENS + 1)]
    assert_error(_lookup(client, {"keys": keys}), 413)
    assert _lookup(client, {"token_ids": tokens[:-1], "model_name": "m"}).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b'{"token_ids": [1,2,3,4], "model_name": "m"', b"\xff\xfe", b"null", b"[]"],
)
def test_lookup_malformed_json(client: httpx.Client, raw: bytes) -> None:
    r = client.post("/directory/lookup", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, 422)


# ------------------------------------------------------------------------------------- events


def _valid_batch(inst: str | None = None, seq: int = 1) -> dict[str, Any]:
    key = wire_key(b"\x42" * 32, model=fresh("vm"))
    return wire_batch(
        inst or fresh("valid"), 1, seq, entries=[wire_entry(key, tokens=[1, 2, 3, 4], offset=0)]
    )


def _bad(**changes: Any) -> dict[str, Any]:
    batch = _valid_batch()
    entry = batch["entries"][0]
    for path, value in changes.items():
        target: dict[str, Any] = batch
        parts = path.split("__")
        for part in parts[:-1]:
            target = entry if part == "entry" else target[part]
        if value is _DROP:
            target.pop(parts[-1])
        else:
            target[parts[-1]] = value
    return batch


_DROP = object()

BAD_BATCHES = {
    "invalid event_type": (_bad(event_type="evict"), "event_type"),
    "invalid tier": (_bad(tier="l3"), "tier"),
    "seq 0": (_bad(seq=0), "seq"),
    "negative incarnation": (_bad(incarnation=-1), "incarnation"),
    "incarnation as string": (_bad(incarnation="1"), "incarnation"),
    "huge incarnation": (_bad(incarnation=2**70), "incarnation"),
    "empty instance_id": (_bad(instance_id=""), "instance_id"),
    "missing instance_id": (_bad(instance_id=_DROP), "instance_id"),
    "store without backend": (_bad(backend=""), "backend"),
    "shared not bool": (_bad(shared="yes"), "shared"),
    "entries not a list": (_bad(entries={"a": 1}), "entries"),
    "negative size_bytes": (_bad(entry__size_bytes=-1), "size_bytes"),
    "size_bytes as float": (_bad(entry__size_bytes=1.5), "size_bytes"),
    "token id 2**32": (_bad(entry__token_ids=[1, 2, 3, 2**32]), "token_ids"),
    "negative token id": (_bad(entry__token_ids=[1, -2, 3, 4]), "token_ids"),
    "token_offset -2": (_bad(entry__token_offset=-2), "token_offset"),
    "63 hex chars": (_bad(entry__key__chunk_hash_hex=HEX63), "chunk_hash_hex"),
    "non-hex chunk hash": (_bad(entry__key__chunk_hash_hex="z" * 64), "chunk_hash_hex"),
    "salt with slash": (_bad(entry__key__cache_salt="a/b"), "cache_salt"),
    "model with at": (_bad(entry__key__model_name="m@1"), "model_name"),
    "kv_rank world size 0": (_bad(entry__key__kv_rank=0), "kv_rank"),
    "unknown key field": (_bad(entry__key__surprise=1), "surprise"),
    "config with entries": (
        _bad(event_type="config", capacity_bytes=1, capacity_revision=1),
        "entries",
    ),
    "config without capacity": (_bad(event_type="config", entries=[]), "capacity"),
    "capacity on a store": (_bad(capacity_bytes=5), "capacity_bytes"),
}


@pytest.mark.parametrize("name", sorted(BAD_BATCHES))
def test_event_bad_batch_rejected_nothing_applied(client: httpx.Client, name: str) -> None:
    bad, needle = BAD_BATCHES[name]
    good = _valid_batch()
    with nothing_applied(client):
        # a valid batch first: it must not be applied either
        r = post_batches(client, good, bad)
        detail = assert_error(r, 422)["detail"]
        assert needle in detail, detail
        assert "batches[1]" in detail, detail


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"not json",
        b"[]",
        b"null",
        b'{"batches": 5}',
        b'{"batches": [1]}',
        b'{"nope": []}',
        b'{"batches": [{"instance_id": "\xff"}]}',
        b'{"batches": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
    ],
)
def test_events_malformed_json(client: httpx.Client, raw: bytes) -> None:
    with nothing_applied(client):
        r = client.post("/events", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, 422)


def _mp_batch(inst: str, seq: int = 1, size: int = 10) -> EventBatch:
    key = ObjectKey(b"\x43" * 32, "mp-model", RANK1)
    return EventBatch(inst, 1, seq, "store", "l1", "dram", entries=(CacheEntry(key, size),))


def _mp_tamper(body: bytes, **changes: Any) -> bytes:
    doc = msgspec.msgpack.decode(body)
    for k, v in changes.items():
        if k == "top_v":
            doc["v"] = v
        elif k.startswith("entry"):
            doc["batches"][-1]["entries"][0][int(k[5:])] = v
        else:
            doc["batches"][-1][k] = v
    return msgspec.msgpack.encode(doc)


MP = {"content-type": "application/msgpack"}


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b"\x00\x01garbage",
        lambda b: b"",
        lambda b: b[: len(b) // 2],
        lambda b: _mp_tamper(b, event_type="evict"),
        lambda b: _mp_tamper(b, top_v=99),
        lambda b: _mp_tamper(b, entry0=b"\x00" * 31),  # 31-byte chunk hash
        lambda b: _mp_tamper(b, entry4="a/b"),  # salt
        lambda b: _mp_tamper(b, entry1="m@x"),  # model
        lambda b: _mp_tamper(b, entry5=-1),  # size_bytes
        lambda b: _mp_tamper(b, entry7=3),  # content ref out of range
        lambda b: _mp_tamper(b, contents=[b"\x00" * 5], entries=[]),  # not a multiple of 4
        lambda b: _mp_tamper(b, seq=0),
        lambda b: json.dumps({"batches": []}).encode(),  # JSON sent as msgpack
    ],
)
def test_events_bad_msgpack_nothing_applied(client: httpx.Client, make: Any) -> None:
    good = _mp_batch(fresh("mpgood"))
    body = encode_msgpack([good, _mp_batch(fresh("mpbad"))])
    with nothing_applied(client):
        assert_error(client.post("/events", content=make(body), headers=MP), 422)


def test_events_valid_then_invalid_batch_changes_nothing(client: httpx.Client) -> None:
    """The headline rule: one invalid batch → 422, the valid batch before it not applied."""
    em, tokens = Emitter(), fresh_tokens(2)
    good = em.store_chunks(tokens)
    bad = wire_batch(em.instance_id, 1, 2, entries=[wire_entry(wire_key(HEX63))])
    with nothing_applied(client):
        assert_error(post_batches(client, good, bad), 422)
    assert lookup_tokens(client, tokens)["prefix"] == []
    assert em.instance_id not in {
        r["instance_id"] for r in client.get("/instances").json()["instances"]
    }
    # the same good batch alone applies (seq 1 was never consumed)
    assert post_batches(client, good).json() == {"applied": 1, "duplicates": 0, "stale": 0}


def test_events_too_many_entries(limited: tuple[BackgroundServer, httpx.Client]) -> None:
    _, client = limited
    inst = fresh("many")
    entries = [wire_entry(wire_key(bytes([i]) * 32)) for i in range(MAX_ENTRIES // 2 + 1)]
    b1 = wire_batch(inst, 1, 1, entries=entries)
    b2 = wire_batch(inst, 1, 2, entries=entries)  # together: more than MAX_ENTRIES
    with nothing_applied(client):
        detail = assert_error(post_batches(client, b1, b2), 413)["detail"]
        assert "max-batch-entries" in detail
    assert post_batches(client, b1).json()["applied"] == 1


def test_events_oversize_body_content_length(
    limited: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, client = limited
    batch = _valid_batch()
    body = json.dumps({"batches": [batch], "pad": "x" * MAX_BODY}).encode()
    with nothing_applied(client):
        assert_error(
            client.post("/events", content=body, headers={"content-type": "application/json"}), 413
        )


def _chunked(body: bytes, piece: int = 512) -> Iterator[bytes]:
    for i in range(0, len(body), piece):
        yield body[i : i + piece]


def test_events_oversize_body_chunked(limited: tuple[BackgroundServer, httpx.Client]) -> None:
    _, client = limited
    body = json.dumps({"batches": [_valid_batch()], "pad": "x" * MAX_BODY}).encode()
    with nothing_applied(client):
        r = client.post(
            "/events", content=_chunked(body), headers={"content-type": "application/json"}
        )
        assert "content-length" not in r.request.headers
        assert_error(r, 413)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/directory/lookup", {"token_ids": [1, 2, 3, 4], "model_name": "m"}),
        ("/directory/blend-lookup", {"token_ids": [1, 2, 3, 4], "model_name": "m"}),
        ("/instances", {"instance_id": "big", "ip": "1.2.3.4"}),
    ],
)
def test_oversize_body_content_length_other_endpoints(
    limited: tuple[BackgroundServer, httpx.Client], path: str, body: dict[str, Any]
) -> None:
    _, client = limited
    raw = json.dumps({**body, "metadata": {"pad": "x" * MAX_BODY}}).encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 413)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/directory/lookup", {"token_ids": [1, 2, 3, 4], "model_name": "m"}),
        ("/directory/blend-lookup", {"token_ids": [1, 2, 3, 4], "model_name": "m"}),
        ("/instances", {"instance_id": "big-chunked", "ip": "1.2.3.4"}),
    ],
)
def test_oversize_body_chunked_other_endpoints(
    limited: tuple[BackgroundServer, httpx.Client], path: str, body: dict[str, Any]
) -> None:
    """Without Content-Length the limit must still answer 413 (not a generic 400)."""
    _, client = limited
    raw = json.dumps({**body, "metadata": {"pad": "x" * MAX_BODY}}).encode()
    r = client.post(path, content=_chunked(raw), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413)
    assert client.get("/healthz").status_code == 200


def test_body_at_limit_is_accepted(limited: tuple[BackgroundServer, httpx.Client]) -> None:
    _, client = limited
    inst = fresh("fits")
    raw = json.dumps({"batches": [wire_batch(inst, 1, 1)]}).encode()
    raw = raw[:-1] + b" " * (MAX_BODY - len(raw)) + b"}"
    assert len(raw) == MAX_BODY
    r = client.post("/events", content=_chunked(raw), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------- instances


@pytest.mark.parametrize(
    "body",
    [
        {"instance_id": "x" * 257},
        {"instance_id": 5},
        {"metadata": "not a dict"},
        {"http_port": "eighty"},
        {"mq_port": [1]},
        "just a string",
    ],
)
def test_register_bad_input(client: httpx.Client, body: Any) -> None:
    before = {r["instance_id"] for r in client.get("/instances").json()["instances"]}
    assert_error(client.post("/instances", json=body), 422)
    assert {r["instance_id"] for r in client.get("/instances").json()["instances"]} == before


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 10_001},
        {"limit": "many"},
        {"offset": -1},
        {"cursor": "zz"},
        {"cursor": "00" * 31},
        {"cursor": "00" * 32 + ":-1"},
        {"cursor": "00" * 32 + ":x"},
        {"tier": "l9"},  # was 200 with total 0: a filter no key can match, read as asked
    ],
)
def test_keys_listing_bad_params(client: httpx.Client, params: dict[str, Any]) -> None:
    assert_error(client.get("/directory/keys", params=params), 422)


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert client.get("/nope").status_code == 404
    assert client.get("/events").status_code == 405
    assert client.get("/healthz").status_code == 200


def test_a_lookup_reply_carries_at_most_what_its_chunks_hold() -> None:
    """A content longer than the chunk size is bound (never an error: docs/directory.md), and
    the keys form answers every key asked, duplicates too, each with its content's ids: one
    stored 100,000-token content and 1,500 copies of its key made a 258 KB request an 883 MB
    reply and 2 GB of server memory. Now a reply is refused (413) before any id is written when
    its ids exceed what the keys' chunks hold at ``chunk_size`` each (the most keys a lookup
    may ask, ``--max-query-tokens / chunk_size``); one at that bound is answered, and so is a
    tokens-form lookup of every rank of the longest query (negative control: world_size times
    --max-query-tokens ids)."""
    limit, length = 4 * CS * 8, 2 * CS  # the most keys: limit // CS = 32, holding 128 ids
    with running(max_query_tokens=limit) as (_, client):
        key = wire_key(fresh("long").encode().ljust(32, b"\0"))
        entry = wire_entry(key, tokens=fresh_tokens(length // CS), offset=0)
        r = post_batches(client, wire_batch(fresh("i"), 1, 1, entries=[entry]))
        assert r.status_code == 200 and r.json()["applied"] == 1, r.text
        fits = _lookup(client, {"keys": [key] * (limit // length)})
        assert fits.status_code == 200, fits.text
        assert [len(row["token_ids"]) for row in fits.json()["results"]] == [length] * (
            limit // length
        )
        detail = assert_error(_lookup(client, {"keys": [key] * (limit // length + 1)}), 413)
        assert "--max-query-tokens" in detail["detail"]
        tokens, em = fresh_tokens(limit // CS), Emitter()
        assert post_batches(client, em.store_chunks(tokens, ws=2)).status_code == 200
        reply = lookup_tokens(client, tokens, world_size=2)
        assert sum(len(row["token_ids"]) for row in reply["results"]) == 2 * limit


@pytest.mark.parametrize("value", ["yes", "", "%ff", "2"])
def test_with_placements_other_than_true_or_false_is_refused(
    client: httpx.Client, value: str
) -> None:
    """``?with_placements=yes`` (or empty, or undecodable) was read as false: a 200 without the
    placements asked for."""
    body = {"tokens_b64": b64(list(range(2 * CS))), "model_name": "m"}
    r = client.post(f"/directory/blend-lookup?with_placements={value}", json=body)
    assert "with_placements" in assert_error(r, 422)["detail"]
    for ok in ("true", "TRUE", "1", "false", "0"):
        r = client.post(f"/directory/blend-lookup?with_placements={ok}", json=body)
        assert r.status_code == 200, r.text


def test_a_trailing_slash_redirect_stays_on_this_server(client: httpx.Client) -> None:
    """The 307 to the path served without (or with) its trailing ``/`` named an absolute URL
    built from the request's ``Host`` header: ``Host: evil.example:1`` redirected there, an
    empty one to ``http:///healthz``. It names the path (and query) on this server now."""
    for host in ("evil.example:1", ""):
        r = client.get("/healthz/?x=1", headers={"host": host}, follow_redirects=False)
        assert (r.status_code, r.headers["location"]) == (307, "/healthz?x=1")
    assert client.get("/healthz/", follow_redirects=True).status_code == 200


def test_head_is_answered_as_get_without_a_body(client: httpx.Client) -> None:
    """A load balancer's health check may use HEAD: it was a 405 on every route. A GET route
    answers HEAD with the GET reply's status and headers (its length too) and no body; a path
    served only by POST still answers 405."""
    get, head = client.get("/healthz"), client.head("/healthz")
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == str(len(get.content))
    assert head.headers["content-type"] == get.headers["content-type"]
    assert client.head("/nope").status_code == 404
    assert client.head("/events").status_code == 405
