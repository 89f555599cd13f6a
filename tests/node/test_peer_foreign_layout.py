"""Two nodes of one fleet under one ``--model-name`` and chunk size in other KV layouts (an
fp32 and an fp16 deployment of one model): their keys are equal (a key names no dtype), so
the directory lists B's chunks for A's keys. A can never use them (its fetch refuses another
layout's chunk), so its lookup must not count them: a connector claims what the lookup counts,
and a claim every load fails is a failed request under vLLM's default load-failure policy.
Each node registers its layout (``metadata.kv_shape``, ``kv_dtype``); a peer whose registered
layout is not this node's is never asked (``peer_skipped_foreign_layout``), and a peer that
sends another layout's chunk anyway (registered without one) is down for a while."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.client import EngineClient
from kvatlas.processes import spawn_services, stop
from tests.conftest import wait_for
from tests.helpers import spawn_coordinator

C = 16
LAYOUTS = {"a": "float32", "b": "float16", "c": "float32"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, str]]:
    coordinator = free_port()
    urls = {"coordinator": f"http://127.0.0.1:{coordinator}"}
    procs = [spawn_coordinator(coordinator, "--chunk-size", str(C))]
    try:
        services = []
        for name, dtype in LAYOUTS.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            services.append(([
                "-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", name,
                "--model-name", "m", "--num-layers", "1", "--num-kv-heads", "1",
                "--head-dim", "8", "--chunk-size", str(C), "--dtype", dtype, "--l2", "none",
                "--coordinator-url", urls["coordinator"], "--coordinator-event-reporting",
                "--fleet-refresh-interval-s", "0.1", "--log-level", "warning",
            ], urls[name]))  # fmt: skip
        procs += spawn_services(services, timeout=120)
        yield urls
    finally:
        stop(procs)


def test_a_peers_chunks_in_another_layout_are_not_counted(fleet: dict[str, str]) -> None:
    clients = {n: EngineClient(fleet[n]) for n in LAYOUTS}
    try:
        rows = httpx.get(f"{fleet['coordinator']}/instances").json()["instances"]
        meta = {r["instance_id"]: r["metadata"] for r in rows}
        assert (meta["b"]["kv_dtype"], meta["b"]["kv_shape"]) == (
            "float16",
            list(clients["b"].layout.shape),
        )
        rng = np.random.default_rng(9)
        ours, theirs = ([int(t) for t in rng.integers(0, 128_256, 2 * C)] for _ in range(2))
        assert clients["b"].store(theirs, [np.ones(clients["b"].layout.shape, np.float16)] * 2) == 2
        assert clients["c"].store(ours, [np.ones(clients["c"].layout.shape, np.float32)] * 2) == 2
        with httpx.Client(base_url=fleet["coordinator"]) as coordinator:
            assert wait_for(lambda: coordinator.get("/directory/stats").json()["keys"] >= 4, 30)
        # the control: a peer of A's layout counts (and is served)
        assert clients["a"].lookup(ours) == 2 * C
        chunks, sources = clients["a"].retrieve(ours)
        assert len(chunks) == 2 and sources == {"peer_l1": 2}
        # B's chunks are listed for A's keys, but never counted nor fetched
        assert clients["a"].lookup(theirs) == 0
        assert clients["a"].retrieve(theirs)[0] == []
        counters = clients["a"].stats()  # (its counters flat beside its figures)
        assert counters["peer_skipped_foreign_layout"] >= 1
        assert counters.get("fetched_wrong_layout", 0) == 0
    finally:
        for client in clients.values():
            client.close()
