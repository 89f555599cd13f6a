"""A node restarted under the engine in another layout (here ``--chunk-size`` 32 where the
engine started against 16, or ``--model-name`` of a fine-tune: the same shapes, other KV)
answers every call, in its new layout. The scheduler reads the layout again after a lookup
that hits and claims nothing from such a node (the old code claimed its hits: every such
request's load failed and was recomputed); the worker reads it again before a step's loads and
stores, and loads and stores nothing from such a node (its rows become load errors: vLLM
recomputes). Before the worker's check, the old code read the new node's chunks in the old
layout: wrong KV in the paged cache, no load error."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest

from kvatlas.client import EngineClient
from kvatlas.coordinator.server import free_port
from kvatlas.node.config import NodeConfig
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import stop
from tests.connector.test_vllm_connector import tiny_node
from tests.vllm_support import require_vllm


def toy(chunk: int, seed: int = 3) -> ToyRopeModel:
    layout = NodeConfig(
        model_name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=chunk,
        dtype="float32",
    ).layout  # fmt: skip
    return ToyRopeModel(layout, seed=seed)


@pytest.mark.parametrize("restart", ["chunk_size", "model_name"])
def test_a_node_restarted_in_another_layout_is_not_used(
    tmp_path: Path, restart: str, caplog: pytest.LogCaptureFixture
) -> None:
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from tests.connector.harness import BLOCK, Engine, make_request

    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def node(chunk: int, model_name: str = "tiny") -> object:
        return tiny_node(tmp_path, port, chunk, timeout=180, model_name=model_name)

    m16 = toy(16)
    prefix = np.random.default_rng(5).integers(0, 100_000, 64)
    procs = [node(16)]
    try:
        engine = Engine.start(url, m16)
        control = engine.run(make_request("before", [*prefix, 7]))  # the positive control
        assert control.matched == 0 and engine.worker.worker.stats()["chunks_saved"] == 4
        again = engine.run(make_request("before-2", [*prefix, 8]))
        assert again.matched == 64 and np.array_equal(
            again.stack().numpy(), m16.kv_chunk(prefix, 0)
        )
        stop(procs)
        if restart == "chunk_size":  # the operator restarts the node with --chunk-size 32
            procs, theirs = [node(32)], toy(32)  # the same KV per token, chunked differently
        else:  # ... or with --model-name of a fine-tune: the same shapes, other KV
            procs, theirs = [node(16, "tiny-ft")], toy(16, seed=4)
        c = theirs.layout.chunk_size
        with EngineClient(url) as other:  # another engine, started against the new node
            kv = theirs.kv_chunk(prefix, 0)
            assert other.store(prefix, [kv[:, :, i : i + c] for i in range(0, 64, c)]) == 64 // c
            assert other.lookup([*prefix, 9]) == 64  # the node holds the prefix (in its layout)
        # the scheduler claims nothing from it: vLLM computes the prompt, nothing fails
        scheduler = engine.scheduler.scheduler.node
        assert engine.match(make_request("after", [*prefix, *range(9, 29)])) == 0
        assert scheduler.failures["layout_changed"] >= 1
        got = engine.run(make_request("after-2", [*prefix, *range(9, 29)]))
        assert got.matched == 0 and engine.load_errors[-1] == set()
        stats = engine.worker.worker.stats()
        assert stats["chunks_saved"] == 4 and stats["stores_dropped_layout_unconfirmed"] >= 1
        # a scheduler whose check held (it confirmed the layout just before the restart)
        # claims the hit; the worker's own check loads nothing of it
        scheduler._layout_good_until = math.inf
        got = engine.run(make_request("raced", [*prefix, *range(9, 29)]))
        assert got.matched == 64
        assert np.isnan(got.stack().numpy()).all()
        assert engine.load_errors[-1] == set(got.block_ids[: 64 // BLOCK])
        stats = engine.worker.worker.stats()
        assert stats["chunks_saved"] == 4 and stats["node_failures"]["layout_changed"] >= 2
        # each side said it once (an ERROR per request or step would flood the log)
        said = [r for r in caplog.records if "its layout is now" in r.getMessage()]
        assert len(said) == 2 and all(r.levelno == logging.ERROR for r in said), said
        engine.close()
    finally:
        stop(procs)  # type: ignore[arg-type]


def test_a_failed_call_drops_the_layouts_confirmation() -> None:
    """The layout, once confirmed, holds a second — unless a call fails in between (a node
    restarting is down first): then the next loads or stores read it again."""
    from kvatlas.client import EngineLayout
    from kvatlas.connector.node_link import NodeLink
    from kvatlas.connector.settings import ConnectorSettings

    link = NodeLink(ConnectorSettings(f"http://127.0.0.1:{free_port()}", retry_s=0.0))
    layout = EngineLayout("tiny", "blake3", 16, 2, 2, 16, "float32", 16, "neox", 1e4, 1, 0, 0)
    link._layout_good_until = float("inf")  # confirmed
    assert link.same_layout(layout)  # held: not read
    assert link.call("retrieve", lambda c: c.node_layout(), None) is None  # nobody listens
    assert not link.same_layout(layout)  # read again: the node does not answer
