"""Two tenants on one coordinator with auth on, both nodes registered: node-a may emit and
look up for salt ``tenant-a`` only, node-b for ``tenant-b`` only (the tenant-isolation tests'
fleet)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvatlas.coordinator.server import BackgroundServer
from tests.coordinator.helpers import running
from tests.coordinator.security_support import bearer, token
from tests.helpers import write_tokens

NODE_A, NODE_B = token("node-a"), token("node-b")


@contextmanager
def two_tenants(tmp_path: Path, **config: Any) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    """A coordinator (chunks of 4 tokens, ``config`` more) with node-a and node-b registered."""
    tokens = write_tokens(
        tmp_path / "tokens.json",
        *(
            {"token": tok, "roles": ["emit", "lookup"], "instance_ids": [f"node-{t}"],
             "cache_salts": [f"tenant-{t}"]}
            for t, tok in (("a", NODE_A), ("b", NODE_B))
        ),
    )  # fmt: skip
    with running(auth_token_file=tokens, chunk_size=4, **config) as (server, client):
        for iid, tok in (("node-a", NODE_A), ("node-b", NODE_B)):
            r = client.post(
                "/instances",
                json={"instance_id": iid, "ip": "127.0.0.1", "http_port": 1, "metadata": {}},
                headers=bearer(tok),
            )
            assert r.status_code == 200, r.text
        yield server, client
