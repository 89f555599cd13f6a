"""Inputs the coordinator refuses rather than guesses at (docs/coordinator.md, "Differences
from LMCache"; docs/cache-control.md), over real loopback HTTP: an integer given as a string
or a float, a query parameter that is no integer's digits or is given twice, a key given twice
in one object, a quota that is no finite number, ``-0.0`` (taken as ``0.0``), a model name
beyond ``MAX_MODEL_NAME_CHARS``. Each refusal is a 422 (400 where cache control checks a key
rule, as LMCache answers a bad salt) that names the field, and changes nothing; what LMCache's
clients send still passes, and a key held before the cap is restored from a snapshot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import MAX_MODEL_NAME_CHARS, ObjectKey, pack_kv_rank
from tests.coordinator.helpers import (
    CS,
    assert_error,
    b64,
    cache_control_state,
    fresh,
    hashes,
    post_batches,
    running,
    wire_batch,
    wire_entry,
    wire_key,
)

TOKENS = list(range(100, 148))  # twelve chunks of 4
PATH_MODEL = "/models/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/" + "0" * 40
LONGEST = ("/m" * MAX_MODEL_NAME_CHARS)[:MAX_MODEL_NAME_CHARS]
TOO_LONG = LONGEST + "x"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    with running(enable_blend_lookup=True) as (server, client):
        for inst in ("n1", "n2"):  # MP servers at a port where nothing listens
            r = client.post("/instances", json={"instance_id": inst, "ip": "127.0.0.1", "http_port": 9})  # fmt: skip
            assert r.status_code == 200, r.text
        yield server, client


def send(c: httpx.Client, method: str, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.request(method, path, content=raw, headers={"content-type": "application/json"})


def ids(c: httpx.Client) -> set[str]:
    return {row["instance_id"] for row in c.get("/instances").json()["instances"]}


def fields(**more: Any) -> dict[str, Any]:
    return {"model_name": "m", "world_size": 1, "token_ids": TOKENS, "cache_salt": "", **more}


TOKEN_ROUTES = [
    ("POST", "/cache/pins", {}),
    ("DELETE", "/cache/pins", {}),
    ("POST", "/cache/delete", {"instance_id": "n1"}),
    ("POST", "/cache/prefetches", {"instance_id": "n1"}),
    ("POST", "/cache/moves", {"source_instance_id": "n1", "target_instance_id": "n2"}),
]


def field_named(r: httpx.Response, *loc: str | int) -> None:
    """A 422 whose first error is at ``body`` + ``loc``."""
    body = assert_error(r, 422)
    assert body["errors"][0]["loc"] == ["body", *loc], body


# ------------------------------------------------------------------ integers of another type


@pytest.mark.parametrize(("method", "path", "extra"), TOKEN_ROUTES)
@pytest.mark.parametrize("world_size", ["1", 1.0, "1.0"])
def test_a_world_size_that_is_no_integer_is_refused_on_every_cache_control_route(
    served: tuple[BackgroundServer, httpx.Client],
    method: str,
    path: str,
    extra: dict[str, Any],
    world_size: Any,
) -> None:
    """Was 200 (pins recorded, a delete or prefetch sent, a move recorded): the cache-control
    bodies were decoded laxly, as pydantic reads them; the lookups were strict already."""
    server, c = served
    before = cache_control_state(server)
    r = send(c, method, path, fields(world_size=world_size, **extra))
    field_named(r, "world_size")
    assert r.json()["errors"][0]["type"] == "int_type"
    assert cache_control_state(server) == before


@pytest.mark.parametrize("token", ["100", 100.0])
def test_a_token_id_that_is_no_integer_is_refused(
    served: tuple[BackgroundServer, httpx.Client], token: Any
) -> None:
    server, c = served
    before = cache_control_state(server)
    field_named(send(c, "POST", "/cache/pins", fields(token_ids=[token] * 4)), "token_ids", 0)
    assert cache_control_state(server) == before


def test_the_integers_lmcache_sends_still_pass(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """The positive control: JSON integers, the form LMCache's own clients send (the goldens
    under /work/shared/wire replay through the golden and conformance tests)."""
    _, c = served
    r = send(c, "POST", "/cache/pins", fields(model_name=fresh("int")))
    assert (r.status_code, r.json()["affected"]) == (200, 12), r.text
    r = send(c, "PUT", "/config/chunk-size", {"chunk_size": 4})
    assert r.status_code == 200, r.text
    # registration stays lax, as LMCache reads it (its documented contract: "8000" is a port)
    r = send(c, "POST", "/instances", {"instance_id": fresh("lax"), "ip": "10.0.0.1", "http_port": "8000"})  # fmt: skip
    assert r.status_code == 200, r.text


def test_a_chunk_size_that_is_no_integer_is_refused(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, c = served
    for bad in ("4", 4.0):
        field_named(send(c, "PUT", "/config/chunk-size", {"chunk_size": bad}), "chunk_size")


@pytest.mark.parametrize("path", ["/cache/pins", "/directory/keys", "/instances/n1/pins"])
@pytest.mark.parametrize(("name", "value"), [("limit", "1.0"), ("limit", "1e3"), ("offset", "1.0"), ("offset", "0x1")])  # fmt: skip
def test_an_integer_query_parameter_that_is_no_integer_is_refused(
    served: tuple[BackgroundServer, httpx.Client], path: str, name: str, value: str
) -> None:
    """Was 200 (``limit=1.0`` a page of 1, ``limit=1e3`` one of 1,000)."""
    _, c = served
    r = c.get(path, params={name: value})
    body = assert_error(r, 422)
    assert body["errors"][0]["loc"] == ["query", name], body
    assert c.get(path, params={name: "2" if name == "limit" else "-0"}).status_code == 200


@pytest.mark.parametrize("path", ["/cache/pins", "/directory/keys", "/instances/n1/pins"])
def test_a_query_parameter_given_twice_is_refused(
    served: tuple[BackgroundServer, httpx.Client], path: str
) -> None:
    """Was 200 with the last one taken (``limit=1&limit=2`` a page of 2)."""
    _, c = served
    body = assert_error(c.get(f"{path}?limit=1&limit=2"), 422)
    assert body["errors"][0] == {
        "loc": ["query", "limit"],
        "msg": "Duplicate query parameter 'limit': a parameter may be given once",
        "type": "duplicate_key",
    }, body
    assert c.get(f"{path}?limit=1&offset=0").status_code == 200


def test_with_placements_given_twice_is_refused(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """Was 200 with placements: ``true`` won over ``false`` whatever the order."""
    _, c = served
    body = {"tokens_b64": b64(TOKENS), "model_name": "m"}
    for query in ("with_placements=false&with_placements=true", "with_placements=1&with_placements=1"):  # fmt: skip
        r = c.post(f"/directory/blend-lookup?{query}", json=body)
        assert "given 2 times" in assert_error(r, 422)["detail"], r.text
    assert c.post("/directory/blend-lookup?with_placements=false", json=body).status_code == 200


# ------------------------------------------------------------------ a key given twice


_TOKENS_JSON = b'"model_name":"m","world_size":1,"token_ids":[1,2,3,4]'
DUPLICATES = [
    ("POST", "/cache/pins", b'{"world_size":2,' + _TOKENS_JSON + b"}", "world_size"),
    ("DELETE", "/cache/pins", b"{" + _TOKENS_JSON + b',"model_name":"n"}', "model_name"),
    ("POST", "/cache/delete", b'{"instance_id":"n1","instance_id":"n2",' + _TOKENS_JSON + b"}",
     "instance_id"),
    ("PUT", "/quota/dup", b'{"limit_gb":1.0,"limit_gb":0}', "limit_gb"),
    ("PUT", "/quota/config", b'{"default_limit_gb":null,"default_limit_gb":0}',
     "default_limit_gb"),
    ("POST", "/instances",
     b'{"instance_id":"dup-a","instance_id":"dup-b","ip":"10.0.0.1","http_port":1}',
     "instance_id"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "raw", "key"), DUPLICATES)
def test_a_key_given_twice_is_refused_and_named(
    served: tuple[BackgroundServer, httpx.Client], method: str, path: str, raw: bytes, key: str
) -> None:
    """Was 200 with the last value taken: which one the sender meant, no one can tell."""
    server, c = served
    before = cache_control_state(server), ids(c)
    r = send(c, method, path, raw)
    field_named(r, key)
    assert r.json()["errors"][0]["type"] == "duplicate_key"
    assert key in r.json()["detail"]
    assert (cache_control_state(server), ids(c)) == before
    once = json.dumps(json.loads(raw)).encode()  # the same body with the key once: accepted
    assert send(c, method, path, once).status_code in (200, 502), once


# ------------------------------------------------------------------ quotas


@pytest.mark.parametrize(
    "raw",
    [b'{"limit_gb":"NaN"}', b'{"limit_gb":"Infinity"}', b'{"limit_gb":"1"}', b'{"limit_gb":1e400}',
     b'{"limit_gb":-1}', b'{"limit_gb":8589934593}'],
)  # fmt: skip
def test_a_quota_that_is_no_finite_number_in_range_says_what_it_must_be(
    served: tuple[BackgroundServer, httpx.Client], raw: bytes
) -> None:
    """Was ``should be >= 0`` for ``"NaN"`` (and ``"1"`` was taken as 1.0)."""
    server, c = served
    before = cache_control_state(server)
    r = send(c, "PUT", "/quota/tenant-q", raw)
    field_named(r, "limit_gb")
    assert r.json()["detail"] == "limit_gb: Input should be a finite number >= 0 and <= 8589934592"
    default = raw.replace(b"limit_gb", b"default_limit_gb")
    r = send(c, "PUT", "/quota/config", default)
    assert r.json()["detail"].startswith("default_limit_gb: Input should be a finite number >= 0")
    assert cache_control_state(server) == before


def test_minus_zero_is_the_quota_zero(served: tuple[BackgroundServer, httpx.Client]) -> None:
    """Was echoed, kept and listed as ``-0.0``."""
    _, c = served
    r = send(c, "PUT", "/quota/zero", b'{"limit_gb":-0.0}')
    assert r.status_code == 200 and r.json()["limit_gb"] == 0.0, r.text
    assert "-0.0" not in r.text
    shown = c.get("/quota/zero")
    assert shown.json()["quota_limit_gb"] == 0.0 and "-0.0" not in shown.text
    assert "-0.0" not in c.get("/quota").text
    r = send(c, "PUT", "/quota/config", b'{"default_limit_gb":-0.0}')
    assert r.text == '{"default_limit_gb":0.0}'
    assert c.get("/quota/config").text == '{"default_limit_gb":0.0}'
    assert send(c, "PUT", "/quota/config", {"default_limit_gb": None}).status_code == 200


def test_minus_zero_weights_score_zero(served: tuple[BackgroundServer, httpx.Client]) -> None:
    """Was ``"score": -0.0`` in the reply: ``-0.0`` weights (which are >= 0) are ``0.0``."""
    _, c = served
    zero = b'{"gpu":-0.0,"l1":-0.0,"l2":-0.0,"peer":-0.0}'
    body = b'{"tokens_b64":"%s","model_name":"m","weights":%s}' % (b64(TOKENS).encode(), zero)
    r = send(c, "POST", "/route/score", body)
    assert r.status_code == 200 and r.json()["instances"], r.text
    assert "-0.0" not in r.text and {row["score"] for row in r.json()["instances"]} == {0.0}


# ------------------------------------------------------------------ model names


def test_a_model_name_of_the_longest_length_and_a_local_path_pass(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, c = served
    for model in (PATH_MODEL, LONGEST, "meta-llama/Llama-3.1-8B-Instruct"):
        r = send(c, "POST", "/cache/pins", fields(model_name=model))
        assert (r.status_code, r.json()["affected"]) == (200, 12), r.text
        r = send(c, "POST", "/directory/lookup", {"token_ids": TOKENS, "model_name": model})
        assert r.status_code == 200, r.text
        r = send(c, "POST", "/directory/blend-lookup", {"tokens_b64": b64(TOKENS), "model_name": model})  # fmt: skip
        assert r.status_code == 200, r.text


def _says_model_name(r: httpx.Response, *statuses: int) -> None:
    body = assert_error(r, *statuses)
    assert f"model_name longer than {MAX_MODEL_NAME_CHARS} characters" in body["detail"], body


def test_a_model_name_beyond_the_cap_is_refused_wherever_keys_are_parsed(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """Was accepted and pinned (a 100,000-character name): held in every key, listing and
    snapshot. Now one rule (``check_model_name``) for every path that parses a key."""
    server, c = served
    before = cache_control_state(server), c.get("/directory/stats").json()["num_keys"]
    for method, path, extra in TOKEN_ROUTES:
        _says_model_name(send(c, method, path, fields(model_name=TOO_LONG, **extra)), 400)
    key = wire_key(hashes(TOKENS[:4])[0], model=TOO_LONG)
    for path, body in (
        ("/directory/lookup", {"token_ids": TOKENS, "model_name": TOO_LONG}),
        ("/directory/lookup", {"keys": [key]}),
        ("/directory/blend-lookup", {"tokens_b64": b64(TOKENS), "model_name": TOO_LONG}),
        ("/route/score", {"tokens_b64": b64(TOKENS), "model_name": TOO_LONG}),
    ):
        _says_model_name(send(c, "POST", path, body), 422)
    batch = wire_batch(fresh("long"), 1, 1, entries=[wire_entry(key, tokens=TOKENS[:4])])
    r = post_batches(c, batch)
    _says_model_name(r, 422)
    r = c.post("/events", content=msgspec.msgpack.encode({"batches": [batch]}),
               headers={"content-type": "application/msgpack"})  # fmt: skip
    assert r.status_code == 422 and "model_name" in r.text, r.text
    assert (cache_control_state(server), c.get("/directory/stats").json()["num_keys"]) == before


def test_a_key_held_before_the_cap_is_restored_from_a_snapshot(tmp_path: Path) -> None:
    """The cap is checked where keys come in (requests, events, settings), not by ``ObjectKey``
    itself: a snapshot written before it, holding a longer name, restores whole (with the cap
    in ``ObjectKey`` the reader refused the snapshot and the coordinator started empty: every
    tenant's keys lost for one name). The name is refused anew at the wire."""
    config = CoordinatorConfig(port=free_port(), chunk_size=CS, snapshot_path=tmp_path / "d.snap")
    held = ObjectKey(hashes(TOKENS[:CS])[0], TOO_LONG, pack_kv_rank(1, 0, 1, 0))
    other = ObjectKey(hashes(TOKENS[CS : 2 * CS])[0], "m", pack_kv_rank(1, 0, 1, 0))
    entries = (CacheEntry(held, 64, None, 0), CacheEntry(other, 64, None, CS))
    with BackgroundServer(config) as server:  # as a coordinator before the cap took it
        server.service.directory.consume(EventBatch("old", 1, 1, "store", "l1", "dram", entries=entries))  # fmt: skip
    with BackgroundServer(config) as server, httpx.Client(base_url=server.url) as c:
        listed = c.get("/directory/keys").json()
        assert sorted(len(row["key"]["model_name"]) for row in listed["keys"]) == [1, len(TOO_LONG)]
        key = wire_key(held.chunk_hash, model=TOO_LONG)
        _says_model_name(send(c, "POST", "/directory/lookup", {"keys": [key]}), 422)
