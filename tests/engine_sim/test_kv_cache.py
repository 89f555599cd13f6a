"""The paged prefix cache and the scheduler, without a process: LRU of unreferenced blocks,
references pin, chunked prefill, prefix reuse, CPU offload; and the events they publish,
replayed naively, always equal the cache's own state (the router's view is never stale)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.engine_sim import CPU, GPU, BlockPool, CostModel, EngineCore, SimRequest
from kvatlas.engine_sim.block_hash import block_hashes
from kvatlas.events.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BS = 16


def run(core: EngineCore, *requests: SimRequest) -> list[KVEvent]:
    events: list[KVEvent] = []
    now = 0.0
    for r in requests:
        core.add(r)
    while core.has_work():
        outcome = core.step(now)
        events += outcome.events
        now += outcome.duration_s or 0.01
    return events


def request(name: str, tokens: list[int], max_tokens: int = 2) -> SimRequest:
    return SimRequest(name, tokens, max_tokens, 0.0)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_256) for _ in range(n)]


def removed(events: list[KVEvent], medium: str) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes]  # type: ignore[misc]  # fmt: skip


def test_repeated_prompt_reuses_all_but_the_last_token() -> None:
    core = EngineCore(BlockPool(64, BS), CostModel())
    a, b = request("a", tokens(1, 100)), request("b", tokens(1, 100))
    run(core, a)
    run(core, b)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 96  # 6 full blocks of 100 tokens
    exact = request("c", tokens(1, 96))
    run(core, exact)
    assert exact.num_cached_tokens == 80  # a whole-prompt hit still computes its last block
    assert core.counts.prefix_hits == 96 + 80


def test_lru_evicts_the_least_recently_used_unreferenced_blocks() -> None:
    pool = BlockPool(9, BS)  # 8 usable
    core = EngineCore(pool, CostModel())
    first, second = tokens(1, 3 * BS + 1), tokens(2, 3 * BS + 1)  # 3 full blocks + 1 token
    run(core, request("a", first, 1), request("b", second, 1))
    # "first" again (all 3 full blocks reused): now "second" is the least recently used
    events = run(core, request("a2", first, 1))
    assert removed(events, GPU) == [] and pool.counts.gpu_evictions == 0
    events = run(core, request("c", tokens(3, 5 * BS), 1))  # needs 5 of the 8 blocks
    gone = removed(events, GPU)
    assert len(gone) == 3 and set(gone) == set(block_hashes(second, BS))  # tail block first
    assert gone[0] == block_hashes(second, BS)[-1]
    assert pool.cached_prefix(block_hashes(first, BS)) != []


def test_referenced_blocks_are_never_evicted() -> None:
    pool = BlockPool(5, BS)
    held = pool.allocate(2)
    assert held is not None
    assert pool.allocate(3) is None  # only 2 free: nothing taken
    assert pool.free_blocks == 2 and pool.usage() == 0.5
    pool.release(held)
    assert pool.free_blocks == 4 and pool.usage() == 0.0


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    core = EngineCore(BlockPool(256, BS), CostModel(), max_num_batched_tokens=256)
    r = request("long", tokens(4, 1000), 1)
    core.add(r)
    steps = 0
    while core.has_work():
        outcome = core.step(0.0)
        assert outcome.prefill_tokens <= 256
        steps += 1
    assert steps == 4 and r.output_ids  # 256 + 256 + 256 + 232


def test_cpu_offload_serves_what_the_gpu_evicted() -> None:
    pool = BlockPool(9, BS, cpu_blocks=32)
    core = EngineCore(pool, CostModel())
    doc = tokens(5, 4 * BS + 1)
    events = run(core, request("a", doc, 1))
    assert [e.medium for e in events if isinstance(e, BlockStored)].count(CPU) == 4
    run(core, request("flood", tokens(6, 8 * BS), 1))  # takes all 8 GPU blocks
    assert not pool.cached_prefix(block_hashes(doc, BS))
    again = request("b", doc, 1)
    events = run(core, again)
    assert again.num_cached_tokens == 4 * BS and pool.counts.cpu_loads == 4
    assert core.counts.cpu_hit_tokens == 4 * BS and core.counts.prefix_hits == 0
    assert again.ready_s > 0  # it waited for the load: 4 blocks × 128 KiB over the host link


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(9, BS)
    held = pool.allocate(1)
    assert held is not None and not pool.reset()
    pool.release(held)
    assert pool.reset() and isinstance(pool.take_events()[-1], AllBlocksCleared)


def apply(view: dict[str, set[bytes]], events: list[KVEvent]) -> None:
    for e in events:
        if isinstance(e, AllBlocksCleared):
            view[GPU].clear()
            view[CPU].clear()
        elif isinstance(e, BlockStored):
            view[str(e.medium)].update(e.block_hashes)  # type: ignore[arg-type]
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                assert h in view[str(e.medium)], "a removal of a block never stored"
                view[str(e.medium)].discard(h)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6 * BS), st.integers(1, 20)),
             min_size=1, max_size=25),
    st.integers(6, 40), st.integers(0, 12), st.integers(16, 256),
)  # fmt: skip
def test_events_replayed_naively_equal_the_cache(
    shapes: list[tuple[int, int, int]], gpu_blocks: int, cpu_blocks: int, budget: int
) -> None:
    """Requests over a few shared prefixes, arriving mid-run, with preemptions: a router that
    applies the events in order holds exactly the pool's GPU and CPU blocks after every step."""
    pool = BlockPool(gpu_blocks, BS, cpu_blocks)
    core = EngineCore(pool, CostModel(), max_num_batched_tokens=budget, max_num_seqs=8)
    view: dict[str, set[bytes]] = {GPU: set(), CPU: set()}
    pending = [request(f"r{i}", tokens(doc, n), out) for i, (doc, n, out) in enumerate(shapes)
               if -(-(n + out) // BS) <= gpu_blocks - 1]  # fmt: skip
    now = 0.0
    for step in range(10_000):
        if pending and step % 2 == 0:
            core.add(pending.pop(0))
        if not pending and not core.has_work():
            break
        outcome = core.step(now)
        now += outcome.duration_s or 0.01
        apply(view, outcome.events)
        assert view[GPU] == set(pool.cached), step
        assert view[CPU] == set(pool.cpu._lru), step
        referenced = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert referenced + pool.free_blocks == pool.usable_blocks
    else:
        raise AssertionError("the engine never drained")


def ttft(core: EngineCore, req: SimRequest) -> float:
    core.add(req)
    now = 0.0
    while req.first_token_s is None:
        outcome = core.step(now)
        now += outcome.duration_s
        if any(o.request is req for o in outcome.outputs):
            req.first_token_s = now
    while core.has_work():
        now += core.step(now).duration_s or 0.01
    return req.first_token_s


def test_time_to_first_token_follows_the_cost_model() -> None:
    """On the model clock: a 20,000-token prompt takes three chunked-prefill steps priced by the
    roofline; the same prompt again computes only its last block."""
    cost = CostModel()
    core = EngineCore(BlockPool(2048, BS), cost, max_num_batched_tokens=8192)
    prompt = tokens(9, 20_000)
    cold = ttft(core, request("cold", prompt))
    chunks = [(0, 8192), (8192, 8192), (16384, 3616)]
    expected = sum(cost.step_seconds(n, n * done + n * (n + 1) // 2, 0, 0) for done, n in chunks)
    assert abs(cold - expected) < 1e-9
    warm = ttft(core, request("warm", prompt))
    reused = (20_000 - 1) // BS * BS
    n = 20_000 - reused
    assert abs(warm - cost.step_seconds(n, n * reused + n * (n + 1) // 2, 0, 0)) < 1e-9
    assert warm < cold / 10


def test_fragments_cost_only_their_recompute_share() -> None:
    """Tokens a node supplies at another offset are loaded, not computed, but for the
    recompute share: the prefill step is priced on the rest plus that share."""
    cost = CostModel()
    core = EngineCore(BlockPool(256, BS), cost)
    prompt = tokens(11, 1000)
    plain = request("plain", prompt, 1)
    blended = request("blended", tokens(12, 1000), 1)
    blended.fragments, blended.recompute_share, blended.fragment_load_s = ((200, 512),), 0.15, 0.0
    cold = ttft(core, plain)
    warm = ttft(core, blended)
    scale = 1 - 0.85 * 512 / 1000  # the tokens and the attention both shrink by it
    expected = cost.step_seconds(round(1000 * scale), round(1000 * 1001 // 2 * scale), 0, 0)
    assert abs(warm - expected) < 1e-9
    assert warm < cold and core.counts.fragment_tokens == 512
