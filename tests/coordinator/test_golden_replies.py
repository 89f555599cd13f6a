"""Golden replies: every endpoint's exact bytes (status, body, field order, the headers clients
read) for one fixed scenario, recorded before the coordinator's HTTP layer was split into
modules. A refactoring of routes, wire mapping or errors must leave every byte unchanged.

Volatile numbers (wall-clock timestamps, ages) are masked; everything else is compared as is.
``golden_replies.json`` is the recording; regenerate it only for an intended wire change:
``KVATLAS_RECORD_GOLDEN=1 pytest tests/coordinator/test_golden_replies.py``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.coordinator.helpers import b64, hashes, running, wire_batch, wire_entry, wire_key
from tests.helpers import write_tokens

GOLDEN = Path(__file__).with_name("golden_replies.json")
_VOLATILE = re.compile(
    rb'"(registration_time|last_heartbeat_age_s|last_access|seconds_since_last_event'
    rb'|event_delivery_delay_seconds)":[-0-9.e+]+'
)
_ASSIGNED_ID = re.compile(rb'"mp-[0-9a-f]{32}"')  # an id the coordinator assigns (random)
_HEADERS = ("content-type", "www-authenticate", "x-kvatlas-blend")
_OPENAPI_VOLATILE = ("/events",)  # its body schema is generated from the event model

TOKENS = list(range(1000, 1012))  # three chunks of 4
ADMIN, EMIT, LOOKUP = (f"golden-{role}-token-{'x' * 32}" for role in ("admin", "emit", "lookup"))


def _reply(r: httpx.Response) -> dict[str, Any]:
    headers = {h: r.headers[h] for h in _HEADERS if h in r.headers}
    body = _ASSIGNED_ID.sub(b'"mp-*"', _VOLATILE.sub(rb'"\1":"*"', r.content))
    return {"status": r.status_code, "headers": headers, "body": body.decode()}


def _store_batch(instance: str, seq: int, **kw: Any) -> dict[str, Any]:
    entries = [
        wire_entry(wire_key(h), size=100, tokens=TOKENS[i * 4 : (i + 1) * 4], offset=i * 4)
        for i, h in enumerate(hashes(TOKENS)[:2])
    ]
    return wire_batch(instance, 1, seq, "store", entries=entries, **kw)


def _open_scenario(c: httpx.Client) -> Iterator[tuple[str, httpx.Response]]:
    register = {
        "instance_id": "g-a",
        "ip": "10.0.0.1",
        "http_port": 8000,
        "metadata": {"gpu": 0, "model": "m"},
        "p2p_advertised_url": "http://10.0.0.1:8001",
        "mq_port": 5555,
    }
    yield "register", c.post("/instances", json=register)
    yield "register_again", c.post("/instances", json=register)
    yield "register_empty_id", c.post("/instances", json={"instance_id": ""})  # LMCache: assigned
    yield "register_not_object", c.post("/instances", json=[1])
    yield "heartbeat", c.put("/instances/g-a/heartbeat")
    yield "heartbeat_unknown", c.put("/instances/g-nope/heartbeat")
    events = {"batches": [_store_batch("g-a", 1)]}
    yield "events", c.post("/events", json=events)
    yield "events_duplicate", c.post("/events", json=events)
    l2 = _store_batch("g-b", 1, tier="l2", backend="redis", shared=True)
    yield "events_l2_shared", c.post("/events", json={"batches": [l2]})
    config = wire_batch("g-a", 1, 2, "config", capacity_bytes=1 << 30, capacity_revision=1)
    yield "events_config", c.post("/events", json={"batches": [config]})
    yield (
        "events_bad_tier",
        c.post("/events", json={"batches": [wire_batch("g-c", 1, 1, tier="l9")]}),
    )
    yield "events_bad_json", c.post("/events", content=b"{not json")
    yield (
        "events_bad_msgpack",
        c.post("/events", content=b"\xc1", headers={"content-type": "application/msgpack"}),
    )
    keys = [wire_key(h) for h in hashes(TOKENS)]
    yield "lookup_keys", c.post("/directory/lookup", json={"keys": keys})
    yield "lookup_keys_bad_hex", c.post("/directory/lookup", json={"keys": [wire_key("zz" * 32)]})
    yield (
        "lookup_tokens",
        c.post("/directory/lookup", json={"token_ids": TOKENS, "model_name": "m"}),
    )
    yield (
        "lookup_b64",
        c.post("/directory/lookup", json={"tokens_b64": b64(TOKENS), "model_name": "m"}),
    )
    yield (
        "lookup_both_forms",
        c.post("/directory/lookup", json={"keys": keys, "token_ids": TOKENS, "model_name": "m"}),
    )
    yield "lookup_no_model", c.post("/directory/lookup", json={"token_ids": TOKENS})
    yield (
        "lookup_ids_and_b64",
        c.post(
            "/directory/lookup",
            json={"token_ids": [1], "tokens_b64": "AQAAAA==", "model_name": "m"},
        ),
    )
    yield (
        "lookup_bad_b64",
        c.post("/directory/lookup", json={"tokens_b64": "!!", "model_name": "m"}),
    )
    yield (
        "lookup_b64_not_u32",
        c.post("/directory/lookup", json={"tokens_b64": "AQID", "model_name": "m"}),
    )
    yield (
        "lookup_bad_token",
        c.post("/directory/lookup", json={"token_ids": [-1], "model_name": "m"}),
    )
    yield (
        "lookup_bad_world_size",
        c.post("/directory/lookup", json={"token_ids": TOKENS, "model_name": "m", "world_size": 0}),
    )
    yield (
        "lookup_bad_group",
        c.post(
            "/directory/lookup",
            json={"token_ids": TOKENS, "model_name": "m", "object_group_id": -1},
        ),
    )
    yield "lookup_validation", c.post("/directory/lookup", json={"token_ids": "x"})
    query = [7, 7, *TOKENS[:8]]
    yield (
        "blend",
        c.post("/directory/blend-lookup", json={"tokens_b64": b64(query), "model_name": "m"}),
    )
    yield (
        "blend_ids",
        c.post("/directory/blend-lookup", json={"token_ids": query, "model_name": "m"}),
    )
    yield "blend_empty", c.post("/directory/blend-lookup", json={"token_ids": []})
    yield "blend_no_model", c.post("/directory/blend-lookup", json={"token_ids": query})
    yield "blend_bad_body", c.post("/directory/blend-lookup", content=b"[1,2]")
    yield (
        "blend_bad_world_size",
        c.post(
            "/directory/blend-lookup", json={"token_ids": query, "model_name": "m", "world_size": 0}
        ),
    )
    yield "stats", c.get("/directory/stats")
    yield "keys_page1", c.get("/directory/keys", params={"limit": 2})
    cursor = c.get("/directory/keys", params={"limit": 2}).json()["next_cursor"]
    yield "keys_page2", c.get("/directory/keys", params={"limit": 2, "cursor": cursor})
    yield "keys_offset", c.get("/directory/keys", params={"limit": 1, "offset": 1, "tier": "l1"})
    yield "keys_bad_cursor", c.get("/directory/keys", params={"cursor": "nope"})
    yield "keys_bad_limit", c.get("/directory/keys", params={"limit": 0})
    yield "instances", c.get("/instances")
    yield "healthz", c.get("/healthz")
    yield "readyz", c.get("/readyz")
    yield "deregister", c.delete("/instances/g-a")
    yield "deregister_emitter_only", c.delete("/instances/g-b")
    yield "deregister_unknown", c.delete("/instances/g-nope")
    yield "instances_after", c.get("/instances")
    yield "not_found", c.get("/nope")
    yield "method", c.delete("/directory/stats")


def _limited_scenario(c: httpx.Client) -> Iterator[tuple[str, httpx.Response]]:
    many = {"token_ids": list(range(20)), "model_name": "m"}
    yield "lookup_too_many_tokens", c.post("/directory/lookup", json=many)
    yield (
        "lookup_too_many_b64",
        c.post("/directory/lookup", json={"tokens_b64": b64(range(20)), "model_name": "m"}),
    )
    keys = [wire_key(h) for h in hashes(list(range(80)))]
    yield "lookup_too_many_keys", c.post("/directory/lookup", json={"keys": keys})
    yield "blend_too_many_tokens", c.post("/directory/blend-lookup", json=many)
    batch = wire_batch("g-l", 1, 1, entries=[wire_entry(wire_key(h)) for h in hashes(TOKENS)])
    yield "events_too_many_entries", c.post("/events", json={"batches": [batch]})
    yield "events_too_large", c.post("/events", content=b"x" * 5000)


def _auth_scenario(c: httpx.Client) -> Iterator[tuple[str, httpx.Response]]:
    def h(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    yield "auth_missing", c.get("/directory/stats")
    yield "auth_scheme", c.get("/directory/stats", headers={"Authorization": "Basic x"})
    yield "auth_unknown", c.get("/directory/stats", headers=h("not-a-known-token"))
    yield "auth_role", c.get("/directory/keys", headers=h(LOOKUP))
    yield "auth_instance", c.put("/instances/other/heartbeat", headers=h(EMIT))
    yield (
        "auth_salt",
        c.post(
            "/directory/lookup",
            json={"token_ids": TOKENS, "model_name": "m", "cache_salt": "b"},
            headers=h(LOOKUP),
        ),
    )
    yield "auth_blend_missing", c.post("/directory/blend-lookup", json={"token_ids": []})
    yield (
        "auth_blend_salt",
        c.post(
            "/directory/blend-lookup", json={"token_ids": [], "cache_salt": "b"}, headers=h(LOOKUP)
        ),
    )
    yield (
        "auth_blend_ok",
        c.post(
            "/directory/blend-lookup", json={"token_ids": [], "cache_salt": "a"}, headers=h(LOOKUP)
        ),
    )
    yield "auth_events_role", c.post("/events", json={"batches": []}, headers=h(LOOKUP))
    yield "auth_healthz", c.get("/healthz")


def _openapi(c: httpx.Client) -> Iterator[tuple[str, httpx.Response]]:
    r = c.get("/openapi.json")
    doc = r.json()
    for path in _OPENAPI_VOLATILE:
        doc["paths"][path]["post"].pop("requestBody")
    yield "openapi", httpx.Response(r.status_code, json=doc)


def _record_all(tmp_path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with running(enable_blend_lookup=True, replica_id="golden") as (_, c):
        out.update((name, _reply(r)) for name, r in _open_scenario(c))
        out.update((name, _reply(r)) for name, r in _openapi(c))
    limits = {"max_query_tokens": 10, "max_batch_entries": 2, "max_body_bytes": 4096}
    with running(enable_blend_lookup=True, replica_id="golden", **limits) as (_, c):
        out.update((name, _reply(r)) for name, r in _limited_scenario(c))
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": EMIT, "role": "emit", "instance_ids": ["g-a"]},
        {"token": LOOKUP, "role": "lookup", "cache_salts": ["a"]},
    )
    # blend pinned off: this scenario records the disabled-blend replies (LMCache's default)
    with running(auth_token_file=tokens, replica_id="golden", enable_blend_lookup=False) as (_, c):
        out.update((name, _reply(r)) for name, r in _auth_scenario(c))
    return out


def test_every_reply_is_byte_identical_to_the_recording(tmp_path: Path) -> None:
    got = _record_all(tmp_path)
    if os.environ.get("KVATLAS_RECORD_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip("recorded")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name
