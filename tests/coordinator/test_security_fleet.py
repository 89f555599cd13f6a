"""Issue 16 item 4: a whole fleet with auth on and no admin token anywhere. A coordinator and
two real `kvatlas node` processes, each holding one token with roles emit + lookup bound to its
own instance and its tenant's salt: register, heartbeat, events, fleet view, prefix and blend
lookups, a peer fetch — every call a node makes is allowed; nothing is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.node.toy_model import ToyRopeModel
from tests.conftest import wait_for
from tests.coordinator.security_support import bearer, token
from tests.helpers import process_fleet, write_tokens

C = 16
SALT = "tenant-t"
TOKENS = {name: token(name) for name in ("node-a", "node-b")}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    path = write_tokens(
        tmp_path / "tokens.json",
        *(
            {
                "token": tok,
                "roles": ["emit", "lookup"],
                "instance_ids": [name],
                "cache_salts": [SALT],
            }
            for name, tok in TOKENS.items()
        ),
    )
    assert "admin" not in path.read_text()
    flags = ["--auth-token-file", str(path), "--chunk-size", str(C), "--enable-blend-lookup"]
    nodes = {name: ["--coordinator-token", tok] for name, tok in TOKENS.items()}
    with process_fleet(flags, nodes, ["--coordinator-blend-timeout", "20"]) as fleet:
        yield fleet


def test_fleet_runs_with_node_tokens_only(fleet: dict[str, Any]) -> None:
    a, b = fleet["node-a"], fleet["node-b"]
    model = ToyRopeModel(fleet["layout"])
    rng = np.random.default_rng(7)
    doc = rng.integers(0, 500, 3 * C).astype(np.uint32)
    first = np.concatenate([rng.integers(0, 500, 2 * C).astype(np.uint32), doc])
    assert a.store(first, model.kv_chunks(first), cache_salt=SALT, request_id="s1") == 5
    # B's prefix lookup and retrieval go through the coordinator (B's token) to A's L1
    assert wait_for(lambda: b.lookup(first, cache_salt=SALT) == 5 * C, timeout=30)
    chunks, sources = b.retrieve(first, cache_salt=SALT, request_id="r1")
    assert sources == {"peer_l1": 5}, sources
    for i, kv in enumerate(chunks):
        np.testing.assert_allclose(kv, model.kv_chunk(first[i * C : (i + 1) * C], i * C), atol=1e-5)
    # blend: the document at a new offset, found by the coordinator's blend lookup
    q = 5
    query = np.concatenate([rng.integers(0, 500, q).astype(np.uint32), doc])
    answers: list[Any] = []
    assert wait_for(
        lambda: (
            answers.append(b.blend_lookup(query, "b1", cache_salt=SALT)) or answers[-1] is not None
        ),
        timeout=30,
    )
    segments = answers[-1]
    assert [(s.old_st, s.cur_st) for s in segments] == [
        (2 * C, q),
        (3 * C, q + C),
        (4 * C, q + 2 * C),
    ]
    got = b.blend_retrieve(query, "b1", segments, cache_salt=SALT)
    assert got["misses"] == [] and got["sources"] == {"peer_l1": 3}
    # nothing a node did was refused: no auth failures in either node's event sink
    for node in (a, b):
        assert node.stats()["event_sink"]["auth_failures"] == 0
    # each node's token sees the fleet it needs, itself in full, the peer as id + URL
    coord = fleet["coordinator"]
    rows = httpx.get(f"{coord}/instances", headers=bearer(TOKENS["node-b"])).json()["instances"]
    by_id = {row["instance_id"]: row for row in rows}
    assert set(by_id) == {"node-a", "node-b"}
    assert by_id["node-a"]["p2p_advertised_url"].startswith("http://127.0.0.1:")
    # and it cannot act for its peer: deregistering A is refused, A stays registered
    r = httpx.delete(f"{coord}/instances/node-a", headers=bearer(TOKENS["node-b"]))
    assert r.status_code == 403, r.text
    r = httpx.get(f"{coord}/directory/keys", headers=bearer(TOKENS["node-b"]))
    assert r.status_code == 403, r.text
