"""A chunk held under keys of several salts has each salt's binding indexed in the blend index
under an occupant hash of its own, which a match maps back to the real chunk hash
(directory/tenant_bindings.py). The blend route reads the index (``match_columns``, the
index lock only) and maps the occupants afterwards (``chunk_matches``), with no lock between:
an ingest worker that makes a salt leave the chunk in between (its last key deleted) applies
its index writes and forgets the occupants (``TenantBindings.applied``), and the reply then
carries an occupant hash — a 32-byte hash no tenant ever stored.

Found over HTTP with a real coordinator process (tenant b storing and deleting, in large
``POST /events`` bodies, the chunks tenant a holds while both tenants' blend lookups of a
long query run: within a minute a reply carried an unknown hash). Here the interleaving is
made deterministic: the delete is applied right after the index read.

Contract: docs/security.md (a tenant reads back and matches only what it stored itself),
docs/directory.md ("A chunk held under keys of several cache salts has one binding per
salt"), the ``TenantBindings.leave`` docstring ("a match before still maps them back")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.coordinator.helpers import Emitter, b64, post_batches, wire_entry, wire_key
from tests.coordinator.security_support import bearer
from tests.coordinator.two_tenants import NODE_A, NODE_B, two_tenants

A_TOKENS = [11, 12, 13, 14]
H = chunk_hashes(A_TOKENS, 4)[0]


@pytest.mark.parametrize("asker", ["a", "b"])
def test_a_blend_reply_never_carries_an_occupant_hash_when_a_salt_leaves_mid_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asker: str
) -> None:
    with two_tenants(tmp_path, enable_blend_lookup=True) as (server, client):
        emitters = {"a": Emitter("node-a"), "b": Emitter("node-b")}
        for salt, tok in (("a", NODE_A), ("b", NODE_B)):
            stored = emitters[salt].batch(
                "store",
                entries=[wire_entry(wire_key(H, salt=f"tenant-{salt}"), 10, A_TOKENS, 0)],
            )
            assert post_batches(client, stored, headers=bearer(tok)).status_code == 200

        directory = server.service.directory
        index = directory.blend_index
        assert index is not None
        read_index = index.match_columns
        leaver = "b" if asker == "a" else "a"

        def read_then_a_salt_leaves(query: Any, namespace: Any) -> Any:
            found = read_index(query, namespace)
            # an ingest worker's turn between the route's index read and its mapping: the
            # other tenant deletes its key of the chunk (it goes back to one salt)
            em = emitters[leaver]
            em.seq += 1
            gone = ObjectKey(H, "m", pack_kv_rank(1, 0, 1, 0), 0, f"tenant-{leaver}")
            deleted = (CacheEntry(gone, 10, None, -1),)
            directory.consume(
                EventBatch(
                    em.instance_id, em.incarnation, em.seq, "delete", "l1", "dram", entries=deleted
                )
            )
            return found

        monkeypatch.setattr(index, "match_columns", read_then_a_salt_leaves)
        r = client.post(
            "/directory/blend-lookup",
            json={"tokens_b64": b64([1, *A_TOKENS]), "model_name": "m",
                  "cache_salt": f"tenant-{asker}"},
            headers=bearer(NODE_A if asker == "a" else NODE_B),
        )  # fmt: skip
        assert r.status_code == 200, r.text
        hashes = {m["chunk_hash"] for m in r.json()["matches"]}
        assert hashes <= {H.hex()}, f"not a chunk hash {asker} stored: {hashes - {H.hex()}}"
