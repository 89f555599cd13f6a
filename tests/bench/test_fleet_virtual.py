"""``kvatlas bench fleet --mode virtual``'s core: deterministic, conserving, and the
directory, the nodes and their capacities matter exactly where they should."""

from __future__ import annotations

import numpy as np
import pytest

from kvatlas.bench.fleet import STACKS, summarize
from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.sim_coordinator import L1_BACKEND, SimCoordinator
from kvatlas.bench.fleet.virtual import VirtualFleet, run_stack
from kvatlas.directory import KeyFilter
from kvatlas.workloads import TraceRequest, open_workload

RAG = "rag:docs=20,k=3,zipf=1.1,rate=4,seed=1"


def small(trace: str, **sizes: int) -> FleetConfig:
    """Four small engines: every GPU holds a few dozen 2k-token prompts."""
    base = {"engines": 4, "gpu_blocks": 2048, "host_blocks": 1024, "max_num_batched_tokens": 2048}
    return FleetConfig(trace, (), **{**base, **sizes})  # type: ignore[arg-type]


def rag(n: int) -> list[TraceRequest]:
    return list(open_workload(RAG, n))


def repeated(distinct: int = 5, times: int = 4, tokens: int = 2048) -> list[TraceRequest]:
    """``distinct`` prompts, each sent ``times`` times, one request every 2 s (no queueing);
    with 5 prompts on 4 engines round-robin sends each repeat to another engine."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 128_256, tokens) for _ in range(distinct)]
    return [TraceRequest(i, 2.0 * i, prompts[i % distinct], 4) for i in range(distinct * times)]


def quiet(_: str) -> None:
    pass


@pytest.mark.parametrize("name", ["kvatlas", "prefix", "random"])
def test_same_config_same_records(name: str) -> None:
    config, requests = small(RAG), rag(30)
    first = run_stack(config, STACKS[name], requests, quiet)
    again = run_stack(config, STACKS[name], requests, quiet)
    assert first == again


@pytest.mark.parametrize("name", ["kvatlas", "prefix", "round-robin", "prefix+connector"])
def test_every_request_gets_one_sane_record(name: str) -> None:
    requests = rag(30)
    lines: list[str] = []
    records = run_stack(small(RAG), STACKS[name], requests, lines.append)
    assert [r.index for r in records] == [q.index for q in requests]
    for r, q in zip(records, requests, strict=True):
        assert r.prompt_tokens == q.input_tokens
        assert r.arrival_s == pytest.approx(q.arrival_s)
        assert r.ttft_s > 0
        assert r.finished_s >= r.first_token_s
        assert 0 <= r.fragment_tokens <= r.reused_tokens <= r.prompt_tokens
        assert r.output_tokens == q.output_tokens
        assert r.engine in {"e0", "e1", "e2", "e3"}
    assert lines and lines[-1].startswith("30/30 requests")  # the command adds the stack


def test_load_scale_compresses_arrivals() -> None:
    requests = rag(10)
    config = FleetConfig(RAG, (), engines=2, gpu_blocks=2048, load_scale=2.0)
    records = run_stack(config, STACKS["round-robin"], requests, quiet)
    assert [r.arrival_s for r in records] == pytest.approx([q.arrival_s / 2 for q in requests])


def test_the_directory_is_what_makes_prefix_routing_reuse() -> None:
    """Repeated prompts: the prefix router sends each repeat where the directory says its
    prompt is cached; round-robin does not. With the directory's answer forced empty the
    prefix router is left with its load scorer and random ties: the gain is the directory's."""
    requests = repeated()
    config = small("repeated")
    prefix = summarize(run_stack(config, STACKS["prefix"], requests, quiet)).hit_ratio
    rr = summarize(run_stack(config, STACKS["round-robin"], requests, quiet)).hit_ratio
    assert prefix > rr + 0.2
    assert prefix > 0.7  # 3 of 4 requests are repeats of a cached prompt

    blind = VirtualFleet(config, STACKS["prefix"], requests, quiet)
    blind.coordinator.score = lambda _tokens, candidates, _peers, _attached: []  # type: ignore[method-assign]
    blind_hit = summarize(blind.run()).hit_ratio
    assert blind_hit < prefix - 0.3  # chance: a repeat lands where its prompt is 1 time in 4


def test_engines_kv_events_reach_the_directory() -> None:
    fleet = VirtualFleet(small("repeated"), STACKS["round-robin"], repeated(2, 1), quiet)
    fleet.run()
    gpu = fleet.coordinator.directory.count_keys(KeyFilter(tier="gpu"))
    cpu = fleet.coordinator.directory.count_keys(KeyFilter(tier="engine-cpu"))
    assert gpu == 2 * 2048 // 256  # every full chunk of both prompts, re-keyed from blocks
    assert cpu == gpu  # written through to the CPU offload tier


def test_fragments_only_with_the_connector() -> None:
    requests = rag(40)
    frags = {
        name: summarize(run_stack(small(RAG), STACKS[name], requests, quiet)).fragment_tokens
        for name in ("kvatlas", "prefix+connector", "prefix", "kvatlas-noconnector")
    }
    assert frags["kvatlas"] > 0 and frags["prefix+connector"] > 0
    assert frags["prefix"] == 0 and frags["kvatlas-noconnector"] == 0


def test_node_l1_capacity_is_respected_and_reported() -> None:
    """host_blocks 64 of 16 tokens: an L1 of 4 chunks per node. Nodes evict, the directory
    lists at most 4 L1 chunks per node, and everything stored is still in the shared pool."""
    config = small(RAG, host_blocks=64)
    fleet = VirtualFleet(config, STACKS["kvatlas"], rag(30), quiet)
    fleet.run()
    directory = fleet.coordinator.directory
    stored = 0
    for engine in fleet.engines:
        node = engine.node
        assert node is not None and node.l1_capacity == 4
        assert len(node.l1) <= 4
        listed = directory.count_keys(
            KeyFilter(tier="l1", instance_id=node.node_id, backend=L1_BACKEND)
        )
        assert listed == len(node.l1)
        stored += node.counts["stored_chunks"]
    assert sum(e.node.counts["l1_evictions"] for e in fleet.engines if e.node) > 0
    assert directory.count_keys(KeyFilter(tier="l2")) == len(fleet.engines[0].node.pool.chunks) > 4


def test_bounded_shared_pool_evicts_and_says_so() -> None:
    config = small(RAG, host_blocks=64, l2_chunks=10)
    fleet = VirtualFleet(config, STACKS["kvatlas"], rag(30), quiet)
    fleet.run()
    pool = fleet.engines[0].node.pool  # type: ignore[union-attr]
    assert len(pool.chunks) == 10
    assert fleet.coordinator.directory.count_keys(KeyFilter(tier="l2")) == 10


def test_sim_coordinator_refuses_nothing_it_is_given() -> None:
    """The in-process coordinator's re-keyer sees every engine block (no unknown parents)."""
    fleet = VirtualFleet(small(RAG), STACKS["prefix"], rag(20), quiet)
    fleet.run()
    counts = fleet.coordinator.subscriber.rekeyer.counts
    assert counts["unknown_parents"] == 0
    assert counts["blocks_stored"] > 0
    assert isinstance(fleet.coordinator, SimCoordinator)
