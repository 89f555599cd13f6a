"""vLLM engine settings the connector must refuse at start or honour, as ``vllm serve`` would
meet them (vLLM 0.33's ``KVConnectorFactory``): parallelism that shards a block's tokens
across workers, an attention backend whose K/V packing is not known or contradicts
``kv_packing``, and ``kv_role``. Each refusal names the setting; none waits for a forward."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.errors import InvalidInput
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import stop
from tests.connector.test_vllm_connector import tiny_node
from tests.vllm_support import require_vllm


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A node of the tiny Llama (``--model-name tiny``, 16-token chunks)."""
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    port = free_port()
    proc = tiny_node(tmp_path_factory.mktemp("node"), port, timeout=180)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop([proc])


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize(("pcp", "dcp"), [(2, 2), (2, 1)], ids=["dcp", "pcp"])
def test_context_parallelism_is_refused(
    model: ToyRopeModel, node: str, role: str, pcp: int, dcp: int
) -> None:
    """Context parallelism (vLLM 0.33: ``prefill_context_parallel_size``,
    ``decode_context_parallel_size``; tp 1, a valid config of world size 2) shards each
    block's tokens across the workers: rows addressed ``block_ids[t // block_size]``, and each
    worker's share stored under the chunk's whole key, would be wrong KV. It started: only tp
    and pp were refused."""
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.connector.harness import engine_configs

    parallel = ParallelConfig(prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp)
    config, cache = engine_configs(node, model.layout, parallel=parallel)
    assert config.parallel_config.world_size == 2
    assert config.parallel_config.tensor_parallel_size == 1
    setting = "decode_context_parallel_size" if dcp > 1 else "prefill_context_parallel_size"
    with pytest.raises(InvalidInput, match=f"parallelism.*{setting}={pcp if dcp == 1 else dcp}"):
        KVConnectorFactory.create_connector(config, KVConnectorRole[role], cache).shutdown()


def test_an_unknown_attention_backend_is_refused_at_start(model: ToyRopeModel, node: str) -> None:
    """Without ``kv_packing`` the packing is the attention backend's: one the connector does
    not know (``FLASHINFER``) is refused when vLLM registers the KV caches (its layers, with
    their backends, are in vLLM's ``static_forward_context`` by then). It was refused inside
    the first forward that loaded or stored, which ends vLLM's engine."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.connector.harness import engine_configs

    config, cache = engine_configs(node, model.layout, packing=None, backend="FLASHINFER")
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, cache)
    pages = {n: torch.zeros(8, 2, 8, 32) for n in cache.kv_cache_groups[0].layer_names}
    with pytest.raises(InvalidInput, match=r"\['FLASHINFER'\].*kv_packing"):
        worker.register_kv_caches(pages)
    worker.shutdown()


def test_a_kv_packing_contradicting_a_known_backend_is_refused(
    model: ToyRopeModel, node: str
) -> None:
    """``kv_packing: split_last`` on vLLM's CPU backend (``CPU_ATTN`` packs ``split_tokens``):
    every chunk stored would hold K rows in place of V (a round trip through the same engine
    is consistent, so nothing looked wrong), and another engine, or a blend re-RoPE of K, would
    read wrong KV. It was taken as given. A setting that agrees with the backend, or none,
    starts; the backend's packing round-trips."""
    from tests.connector.harness import Engine, make_request

    with pytest.raises(InvalidInput, match=r"kv_packing is 'split_last'.*CPU_ATTN"):
        Engine.start(node, model, packing="split_last", backend="CPU_ATTN")
    Engine.start(node, model, packing="split_tokens", backend="CPU_ATTN").close()
    engine = Engine.start(node, model, packing=None, backend="CPU_ATTN")
    prompt = list(range(100, 135))
    assert engine.run(make_request("cold", prompt)).matched == 0
    warm = engine.run(make_request("warm", prompt))
    assert warm.matched == 32 and engine.load_errors[-1] == set()
    assert warm.stack().numpy().tolist() == model.kv_chunk(np.asarray(prompt[:32]), 0).tolist()
    engine.close()


def test_kv_role_is_honoured(model: ToyRopeModel, node: str) -> None:
    """vLLM's ``kv_role``, as its ``KVTransferConfig`` reads it (``is_kv_producer``:
    ``kv_producer`` or ``kv_both``; ``is_kv_consumer``: ``kv_consumer`` or ``kv_both``): a
    consumer (e.g. a decode instance that must not write) loads and stores nothing, a producer
    stores and claims nothing. Both did both: the role was never read."""
    from tests.connector.harness import Engine, make_request

    prefix = [int(t) for t in np.random.default_rng(8).integers(0, 128_256, 32)]
    consumer = Engine.start(node, model, kv_role="kv_consumer")
    assert consumer.run(make_request("consumer-cold", [*prefix, 1, 2, 3])).matched == 0
    assert consumer.worker.worker.stats()["chunks_saved"] == 0  # a consumer writes nothing
    producer = Engine.start(node, model, kv_role="kv_producer")
    assert producer.run(make_request("producer-cold", [*prefix, 4, 5])).matched == 0
    assert producer.worker.worker.stats()["chunks_saved"] == 2
    assert producer.run(make_request("producer-warm", [*prefix, 6])).matched == 0  # no loads
    got = consumer.run(make_request("consumer-warm", [*prefix, 7]))
    assert got.matched == 32 and consumer.load_errors[-1] == set()
    assert consumer.worker.worker.stats()["chunks_saved"] == 0
    assert not producer.scheduler.requires_kv_delivery  # a dropped save is a future miss
    consumer.close()
    producer.close()
