"""A chunk hash is shared by every tenant that stores the same text (the salt is part of the
key, not of the hash). A store by node B, whose emit token is bound to salt ``tenant-b``, of
tenant A's chunk hash must change nothing of what tenant A sees (with other ids it did: A's
blend lookup then returned A's chunk hash at B's tokens, a match A never stored; A's own
content stopped matching; A's keys-form lookup handed back B's ids), and must show B nothing
of A's (a token-less store of A's chunk hash under B's salt read A's ids back: an existence
oracle across tenants). Each salt's binding of the chunk is its own
(directory/tenant_bindings.py).

Contract: spec/keys.md §2 ("A match is only ever served to a requester of a namespace that
stored the chunk ... another tenant's salt is isolated by design"), docs/security.md ("A
tenant is a cache_salt ... isolation holds as long as nobody can store under ... a salt they
do not own"; a node token "cannot ... store ... under another salt"), spec/blend-index.md
"No wrong KV, ever"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvatlas.keys import chunk_hashes
from tests.coordinator.helpers import Emitter, b64, post_batches, wire_entry, wire_key
from tests.coordinator.security_support import bearer
from tests.coordinator.two_tenants import NODE_A, NODE_B, two_tenants

A_TOKENS = [11, 12, 13, 14]
H = chunk_hashes(A_TOKENS, 4)[0]
B_TOKENS = [900, 901, 902, 903]
A_MATCH = {"chunk_hash": H.hex(), "old_st": 0, "cur_st": 1}


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[httpx.Client]:
    """Auth on; node-a (tenant-a) has stored its chunk; node-b may only emit for tenant-b."""
    with two_tenants(tmp_path, enable_blend_lookup=True) as (_, client):
        a = Emitter("node-a")
        stored = a.batch(
            "store", entries=[wire_entry(wire_key(H, salt="tenant-a"), 10, A_TOKENS, 0)]
        )
        assert post_batches(client, stored, headers=bearer(NODE_A)).status_code == 200
        yield client


def _a_matches(client: httpx.Client, query: list[int]) -> list[dict[str, object]]:
    r = client.post(
        "/directory/blend-lookup",
        json={"tokens_b64": b64(query), "model_name": "m", "cache_salt": "tenant-a"},
        headers=bearer(NODE_A),
    )
    assert r.status_code == 200, r.text
    return r.json()["matches"]  # type: ignore[no-any-return]


def _forge(client: httpx.Client, ids: list[int] | None = B_TOKENS) -> None:
    b = Emitter("node-b")
    forged = b.batch("store", entries=[wire_entry(wire_key(H, salt="tenant-b"), 10, ids, 0)])
    r = post_batches(client, forged, headers=bearer(NODE_B))
    assert r.status_code in (200, 409, 422), r.text  # refusing it would do too


def test_another_tenants_tokens_never_match_under_tenant_as_chunk_hash(
    fleet: httpx.Client,
) -> None:
    assert _a_matches(fleet, [1, *A_TOKENS]) == [A_MATCH]
    _forge(fleet)
    assert _a_matches(fleet, [1, *B_TOKENS]) == []  # A never stored H with these tokens


def test_another_tenants_store_does_not_take_tenant_as_match_away(fleet: httpx.Client) -> None:
    _forge(fleet)
    assert _a_matches(fleet, [1, *A_TOKENS]) == [A_MATCH]


def test_tenant_as_key_lookup_returns_tenant_as_tokens(fleet: httpx.Client) -> None:
    _forge(fleet)
    r = fleet.post(
        "/directory/lookup",
        json={"keys": [wire_key(H, salt="tenant-a")]},
        headers=bearer(NODE_A),
    )
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["token_ids"] == A_TOKENS


@pytest.mark.parametrize("ids", [None, B_TOKENS], ids=["no-ids", "junk"])
def test_tenant_b_reads_back_and_matches_nothing_of_tenant_as_chunk(
    fleet: httpx.Client, ids: list[int] | None
) -> None:
    _forge(fleet, ids)
    r = fleet.post(
        "/directory/lookup",
        json={"keys": [wire_key(H, salt="tenant-b")]},
        headers=bearer(NODE_B),
    )
    assert r.status_code == 200, r.text
    (row,) = r.json()["results"]
    assert row["placements"] and row["token_ids"] == (ids or [])  # its own, never A's
    r = fleet.post(
        "/directory/blend-lookup",
        json={"tokens_b64": b64([1, *A_TOKENS]), "model_name": "m", "cache_salt": "tenant-b"},
        headers=bearer(NODE_B),
    )
    assert r.status_code == 200, r.text
    assert r.json()["matches"] == []
