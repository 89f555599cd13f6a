"""With blend lookup off (LMCache's default: ``--no-enable-blend-lookup``), a chunk that goes
back from several salts to one (another tenant's last key of it deleted) leaves an entry
behind in ``TenantBindings`` for ever: ``leave`` queues each of the chunk's salts' occupants
to be forgotten once the index writes are applied, but with no index no write is ever queued,
``ChunkTable.flush_index`` never calls ``TenantBindings.applied`` and the queue (and the
occupant map) only grows. Over HTTP with a real coordinator process: 400 store/delete cycles
of tenant b's keys of 500 chunks tenant a holds (200,000 departures) grew the process by
74 MiB with blend off and by 0 with blend on. With blend on, the same holds while no store
carries a known offset (``token_offset: -1``, nothing indexable: no index write queued).

Contract: docs/directory.md ("Chunks of one salt, nearly all, pay nothing"; a chunk back to
one salt gets that salt's binding back in its record and its entry goes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.keys import chunk_hashes
from tests.coordinator.helpers import Emitter, post_batches, wire_entry, wire_key
from tests.coordinator.security_support import bearer
from tests.coordinator.two_tenants import NODE_A, NODE_B, two_tenants

CHUNKS = [[n, 1, 2, 3] for n in range(50)]


@pytest.mark.parametrize(
    ("blend", "offset"),
    [(False, 0), (True, 0), (True, -1)],
    ids=["blend-off", "blend-on", "blend-on-unknown-offsets"],
)
def test_chunks_back_to_one_salt_leave_nothing_behind(
    tmp_path: Path, blend: bool, offset: int
) -> None:
    hashes = [chunk_hashes(ids, 4)[0] for ids in CHUNKS]
    with two_tenants(tmp_path, enable_blend_lookup=blend) as (server, client):
        a, b = Emitter("node-a"), Emitter("node-b")
        stored = a.batch(
            "store",
            entries=[
                wire_entry(wire_key(h, salt="tenant-a"), 10, ids, offset)
                for h, ids in zip(hashes, CHUNKS, strict=True)
            ],
        )
        assert post_batches(client, stored, headers=bearer(NODE_A)).status_code == 200
        for _ in range(10):  # tenant b stores the same chunks, then deletes them
            b_keys = [wire_key(h, salt="tenant-b") for h in hashes]
            b_stored = b.batch(
                "store",
                entries=[
                    wire_entry(k, 10, ids, 4 if offset == 0 else -1)
                    for k, ids in zip(b_keys, CHUNKS, strict=True)
                ],
            )
            b_deleted = b.batch("delete", entries=[wire_entry(k) for k in b_keys])
            r = post_batches(client, b_stored, b_deleted, headers=bearer(NODE_B))
            assert r.status_code == 200, r.text
            assert r.json()["applied"] == 2

        r = client.post(
            "/directory/lookup",
            json={"keys": [wire_key(hashes[0], salt="tenant-a")]},
            headers=bearer(NODE_A),
        )
        assert r.json()["results"][0]["token_ids"] == CHUNKS[0]  # a's binding is back
        tenants = server.service.directory._chunks.tenants
        assert tenants.rows == {}
        # every chunk is one salt's again: nothing of the departures is kept
        assert len(tenants._leaving) == 0, f"{len(tenants._leaving)} departures kept"
        assert tenants.real == {}
