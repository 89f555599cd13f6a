"""Route scoring across a real fleet (issue 12 item 4, node part): a coordinator with auth on,
two ``kvatlas node`` processes and a registered instance with nothing cached. The node holding
the document's prefix ranks first, the node holding only a fragment second, the empty
instance last; once the first node has shut down (deregistered, its L1 fenced) the ranking
follows; a lookup token bound to salt A scores nothing from salt B's chunks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.api import RouteScoresReply
from kvatlas.client import RouteClient
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.node.toy_model import ToyRopeModel
from tests.conftest import wait_for
from tests.coordinator.security_support import bearer, token
from tests.helpers import process_fleet, toy_node_flags, write_tokens

C = 16
SALT_A, SALT_B = "tenant-a", "tenant-b"
NODE_FLAGS = [*toy_node_flags(C), "--coordinator-url"]
NODES = ("node-a", "node-b")
TOKENS = {name: token(name) for name in (*NODES, "node-c", "router-a", "router-b")}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    path = write_tokens(
        tmp_path / "tokens.json",
        *(
            {
                "token": TOKENS[name],
                "roles": ["emit", "lookup"],
                "instance_ids": [name],
                "cache_salts": [SALT_A, SALT_B],
            }
            for name in (*NODES, "node-c")
        ),
        {"token": TOKENS["router-a"], "roles": ["lookup"], "cache_salts": [SALT_A]},
        {"token": TOKENS["router-b"], "roles": ["lookup"], "cache_salts": [SALT_B]},
    )
    flags = ["--auth-token-file", str(path), "--chunk-size", str(C), "--enable-blend-lookup"]
    nodes = {name: ["--coordinator-token", TOKENS[name]] for name in NODES}
    with process_fleet([*flags, "--instance-timeout", "600"], nodes) as fleet:
        r = httpx.post(
            f"{fleet['coordinator']}/instances",
            json={"instance_id": "node-c"},
            headers=bearer(TOKENS["node-c"]),
        )
        assert r.status_code == 200, r.text
        yield fleet


def ranking(scores: RouteScoresReply) -> list[tuple[str, int, int, float]]:
    return [
        (s.instance_id, s.prefix_tokens, s.fragment_tokens, round(s.score, 3))
        for s in scores.instances
    ]


def test_prefix_holder_first_fragment_holder_second_empty_last(fleet: dict[str, Any]) -> None:
    a, b = fleet["node-a"], fleet["node-b"]
    model = ToyRopeModel(fleet["layout"])
    rng = np.random.default_rng(12)
    doc = rng.integers(0, 500, 4 * C).astype(np.uint32)  # A: the document, 4 chunks
    context = rng.integers(0, 500, 4 * C).astype(np.uint32)  # B: a text whose chunks 2, 3
    fragment = context[2 * C :]  # are quoted by the query
    query = np.concatenate([doc, [1, 2, 3, 4, 5], fragment, [6, 7, 8]]).astype(np.uint32)
    assert a.store(doc, model.kv_chunks(doc), cache_salt=SALT_A, request_id="a1") == 4
    assert b.store(context, model.kv_chunks(context), cache_salt=SALT_A, request_id="b1") == 4
    # under salt B, B holds the query's whole prefix: invisible to salt A
    head = query[: 6 * C]
    assert b.store(head, model.kv_chunks(head), cache_salt=SALT_B, request_id="b2") == 6

    coord = fleet["coordinator"]
    expected = [
        ("node-a", 4 * C, 2 * C, round(0.8 * 64 + 0.85 * 0.6 * 32, 3)),  # + B's L1 as peer
        ("node-b", 0, 6 * C, round(0.85 * (0.6 * 64 + 0.8 * 32), 3)),  # A's L1 + its own
        ("node-c", 0, 6 * C, round(0.85 * 0.6 * 96, 3)),  # all of it from peers
    ]
    with RouteClient(coord, token=TOKENS["router-a"]) as router:
        seen: list[Any] = []
        assert wait_for(
            lambda: (
                seen.append(ranking(router.score(query, "toy", cache_salt=SALT_A)))
                or seen[-1] == expected
            ),
            timeout=60,
        ), seen[-1]
        # the salt-B copies exist (a salt-B router sees B's prefix) and salt A may not ask
        with RouteClient(coord, token=TOKENS["router-b"]) as router_b:
            salt_b = router_b.score(query, "toy", cache_salt=SALT_B)
        assert (salt_b.best, salt_b.instances[0].prefix_tokens) == ("node-b", 6 * C)
        with pytest.raises(CoordinatorError) as refused:
            router.score(query, "toy", cache_salt=SALT_B)
        assert refused.value.reply_status == 403

        procs = fleet["procs"]
        procs[1].terminate()  # node A shuts down: deregisters, its L1 is fenced
        procs[1].wait(timeout=30)
        after = [
            ("node-b", 0, 2 * C, round(0.85 * 0.8 * 32, 3)),
            ("node-c", 0, 2 * C, round(0.85 * 0.6 * 32, 3)),
        ]
        assert wait_for(
            lambda: (
                seen.append(ranking(router.score(query, "toy", cache_salt=SALT_A)))
                or seen[-1] == after
            ),
            timeout=30,
        ), seen[-1]
