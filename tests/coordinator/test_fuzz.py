"""Fuzzing (quality.md "Bad input"): every endpoint from the OpenAPI schema with schemathesis,
the JSON and msgpack event decoders with hypothesis — 0 responses >= 500, 0 partial applies."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.events import CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey
from tests.coordinator.helpers import CS, RANK1, running, wire_batch, wire_entry, wire_key

# The schema is what the app serves at /openapi.json (the pytest plugin needs it at import
# time); each case is sent over real HTTP to the module's running server.
_FUZZ_CONFIG = {"chunk_size": CS, "enable_blend_lookup": True, "max_query_tokens": 4096}
schema = schemathesis.openapi.from_dict(
    create_app(CoordinatorService(CoordinatorConfig(**_FUZZ_CONFIG))).openapi()
)

FUZZ = settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    with running(**_FUZZ_CONFIG) as pair:
        yield pair


def _directory_state(client: httpx.Client) -> Any:
    rows = client.get("/instances").json()["instances"]
    cursors = sorted((r["instance_id"], r["incarnation"], r["last_seq"]) for r in rows)
    s = client.get("/directory/stats").json()
    return (s["keys"], s["placements"], s["bytes_by_tier"], s["batches"], cursors)


@pytest.mark.filterwarnings("ignore:Skipped test cases with unsupported payload media types")
@schema.parametrize()
@FUZZ
def test_schema_fuzz_no_server_errors(
    case: schemathesis.Case, fuzz_server: tuple[BackgroundServer, httpx.Client]
) -> None:
    server, client = fuzz_server
    is_events = case.operation.path == "/events"
    before = _directory_state(client) if is_events else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        response = case.call(base_url=server.url, timeout=30)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text)
    if response.status_code >= 400:
        assert "detail" in response.json(), response.text
        if is_events:  # a rejected event body applied nothing
            assert _directory_state(client) == before


# --------------------------------------------------------------------- event bodies, hand-made

_any_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=70),
)
_hex = st.one_of(
    st.binary(min_size=32, max_size=32).map(bytes.hex),
    st.binary(min_size=32, max_size=32).map(bytes.hex),
    st.text(alphabet="0123456789abcdefABCDEFgz", min_size=62, max_size=66),
)


_BAD_VALUES = st.one_of(
    _any_scalar,
    st.sampled_from(["", "\x00", "a@b", "a/b", "l3", "evict", "g" * 64, "a" * 63, "x" * 300]),
    st.sampled_from([-1, 0, 2**32, 2**64, 2**63]),
    st.lists(st.integers(min_value=-1, max_value=2**32), max_size=3),
    st.dictionaries(st.text(max_size=5), _any_scalar, max_size=2),
)

_valid_key = st.builds(
    lambda h, model, rank, group, salt: {
        "chunk_hash_hex": h.hex(),
        "model_name": model,
        "kv_rank": rank,
        "object_group_id": group,
        "cache_salt": salt,
    },
    st.binary(min_size=32, max_size=32),
    st.sampled_from(["m", "m2"]),
    st.sampled_from([RANK1, 2 << 24 | 1 << 16 | 2 << 8 | 1]),
    st.integers(0, 2),
    st.sampled_from(["", "t"]),
)
_valid_entry = st.builds(
    lambda key, size, tokens, offset: {
        "key": key,
        "size_bytes": size,
        "token_ids": tokens,
        "token_offset": offset,
    },
    _valid_key,
    st.integers(0, 2**20),
    st.one_of(st.none(), st.lists(st.integers(0, 2**32 - 1), min_size=CS, max_size=CS)),
    st.integers(-1, 64),
)


@st.composite
def _valid_batch(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["store", "store", "delete", "access", "config"]))
    batch = wire_batch(
        draw(st.sampled_from(["fz-a", "fz-b"])),
        draw(st.integers(0, 3)),
        draw(st.integers(1, 6)),
        kind,
        tier=draw(st.sampled_from(["l1", "l2"])),
        backend=draw(st.sampled_from(["dram", "fs"])),
        shared=draw(st.booleans()),
        entries=[] if kind == "config" else draw(st.lists(_valid_entry, max_size=4)),
    )
    if kind == "config":
        batch["capacity_bytes"] = draw(st.integers(0, 2**40))
        batch["capacity_revision"] = draw(st.integers(0, 3))
    return batch


@st.composite
def _batch(draw: st.DrawFn) -> dict[str, Any]:
    """A valid batch with 0-2 mutations: a bad value in a batch, entry or key field, or a
    field dropped. Half the bodies stay valid, the rest break in one precise place."""
    batch = draw(_valid_batch())
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        targets: list[dict[str, Any]] = [batch]
        entries = batch.get("entries")
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict):
                targets.append(entry)
                if isinstance(entry.get("key"), dict):
                    targets.append(entry["key"])
        target = draw(st.sampled_from(targets))
        if not target:
            continue
        field = draw(st.sampled_from(sorted(target)))
        if draw(st.integers(0, 5)) == 0:
            del target[field]
        else:
            target[field] = draw(_BAD_VALUES)
    return batch


_VALID = wire_batch(
    "fz-valid",
    1,
    1,
    entries=[wire_entry(wire_key(b"\x11" * 32), tokens=list(range(CS)), offset=0)],
)


@given(batches=st.lists(_batch(), min_size=1, max_size=3), lead_with_valid=st.booleans())
@settings(FUZZ, max_examples=120)
def test_json_events_fuzz_all_or_nothing(
    fuzz_server: tuple[BackgroundServer, httpx.Client],
    batches: list[dict[str, Any]],
    lead_with_valid: bool,
) -> None:
    _, client = fuzz_server
    body = {"batches": ([_VALID] if lead_with_valid else []) + batches}
    try:
        raw = msgspec.json.encode(body)
    except (OverflowError, msgspec.EncodeError):
        return
    before = _directory_state(client)
    r = client.post("/events", content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.status_code in (413, 422), r.text
        assert r.json()["detail"]
        assert _directory_state(client) == before
    else:
        counts = r.json()
        assert sum(counts.values()) == len(body["batches"])


_GOOD_MP = encode_msgpack(
    [
        EventBatch(
            "fz-mp",
            1,
            1,
            "store",
            "l1",
            "dram",
            entries=(CacheEntry(ObjectKey(b"\x22" * 32, "m", RANK1), 8),),
        )
    ]
)


@st.composite
def _mutated_msgpack(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "flip", "truncate", "structured"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "flip":
        raw = bytearray(_GOOD_MP)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
        return bytes(raw)
    if kind == "truncate":
        return _GOOD_MP[: draw(st.integers(0, len(_GOOD_MP) - 1))]
    doc = msgspec.msgpack.decode(_GOOD_MP)
    batch = doc["batches"][0]
    field = draw(st.sampled_from([*batch, "v"]))
    value = draw(
        st.one_of(
            _any_scalar,
            st.binary(max_size=40),
            st.lists(st.one_of(_any_scalar, st.binary(max_size=33)), max_size=9),
        )
    )
    if field == "v":
        doc["v"] = value
    elif field == "entries" and draw(st.booleans()):
        entry = list(batch["entries"][0])
        entry[draw(st.integers(0, len(entry) - 1))] = value
        batch["entries"] = [entry]
    else:
        batch[field] = value
    try:
        return msgspec.msgpack.encode(doc)
    except (OverflowError, msgspec.EncodeError):
        return b"\xc1"


@given(body=_mutated_msgpack())
@settings(FUZZ, max_examples=150)
def test_msgpack_decoder_fuzz(
    fuzz_server: tuple[BackgroundServer, httpx.Client], body: bytes
) -> None:
    _, client = fuzz_server
    before = _directory_state(client)
    r = client.post("/events", content=body, headers={"content-type": "application/msgpack"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.status_code == 422, r.text
        assert r.json()["detail"]
        assert _directory_state(client) == before


_json_value = st.recursive(
    _any_scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, _BAD_VALUES)


_lookup_body = st.fixed_dictionaries(
    {},
    optional={
        "keys": st.lists(_valid_key | _BAD_VALUES, max_size=3) | _BAD_VALUES,
        "token_ids": _maybe(st.lists(st.integers(min_value=-1, max_value=2**33), max_size=10)),
        "tokens_b64": _maybe(st.sampled_from(["", "AAAA", "AAAAAAAA", "AAAAAAA=", "!!", "é"])),
        "model_name": _maybe(st.sampled_from(["m", "", "a@b"])),
        "world_size": _maybe(st.integers(min_value=-1, max_value=300)),
        "cache_salt": _maybe(st.sampled_from(["", "t", "a/b"])),
        "object_group_id": _maybe(st.integers(min_value=-1, max_value=2**70)),
        "extra": _json_value,
    },
)


@given(body=_lookup_body, path=st.sampled_from(["/directory/lookup", "/directory/blend-lookup"]))
@settings(FUZZ, max_examples=120)
def test_lookup_bodies_fuzz(
    fuzz_server: tuple[BackgroundServer, httpx.Client], body: dict[str, Any], path: str
) -> None:
    _, client = fuzz_server
    try:
        raw = msgspec.json.encode(body)
    except (OverflowError, msgspec.EncodeError):
        return
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.status_code in (400, 413, 422), r.text
        assert r.json()["detail"]


def test_server_still_serving_after_fuzz(
    fuzz_server: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, client = fuzz_server
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
