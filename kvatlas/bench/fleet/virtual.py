"""``kvatlas bench fleet --mode virtual``: a discrete-event simulation of one stack in one
process (spec fleet-routing §4).

The same parts as a live fleet, driven by a model clock instead of sockets: N simulated
engines (:class:`~kvatlas.engine_sim.EngineCore` over a
:class:`~kvatlas.engine_sim.BlockPool`, stepped as ``engine_sim.engine`` steps them: a step's
tokens and KV events appear at its end, the next step starts then; an engine idle with
requests still loading wakes when the first is ready), the router's own policy and load
accounting (:class:`~kvatlas.router.policies.Policy`,
:class:`~kvatlas.router.engines.EngineSet`, the engines' gauges refreshed every
``config.metrics_interval_s`` from the trace's start as the router scrapes them), the real
directory and blend index fed by the engines' KV events and the nodes' stores
(:mod:`.sim_coordinator`), and with the connector one node per engine (:mod:`.sim_node`) whose
answer sets the request's reuse as the engine's connector does. Every stack starts cold; the same config, stack and requests give the same
records (ties and the random policy are seeded by ``config.seed``).
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.prompts import Prompt, prompt_cache
from kvatlas.bench.fleet.results import RequestRecord
from kvatlas.bench.fleet.sim_coordinator import SimCoordinator
from kvatlas.bench.fleet.sim_node import SharedPool, SimNode
from kvatlas.bench.fleet.stacks import Stack
from kvatlas.engine_sim import BlockPool, EngineCore, EngineSimConfig, SimRequest, StepOutcome
from kvatlas.engine_sim.cost_model import CostModel as EngineCostModel
from kvatlas.engine_sim.node_connector import NodeReuse, TierRates
from kvatlas.router.config import default_cost_model
from kvatlas.router.engines import VLLM_KV_USAGE, VLLM_RUNNING, VLLM_WAITING, Engine, EngineSet
from kvatlas.router.policies import (
    NO_COVERAGE,
    Candidate,
    Coverage,
    Policy,
    uncomputed_tokens,
)
from kvatlas.workloads import TraceRequest

ARRIVAL, STEP_END, WAKE, SCRAPE = range(4)
IDLE_RETRY_S: Final = 0.001
"""An engine with work but nothing it can run or wait for tries again after this (as
``EngineDriver``)."""
_SIM_DEFAULTS: Final = EngineSimConfig()


@dataclass(slots=True)
class _Served:
    """What the benchmark remembers of a request in flight."""

    index: int
    uncomputed: int
    prompt: Prompt


@dataclass(slots=True)
class _Engine:
    number: int
    engine_id: str
    core: EngineCore
    routed: Engine  # the router's view of it
    node: SimNode | None
    busy: bool = False  # a step is in flight (its end is queued)
    wake: int = 0  # generation of the queued wake-up (an older one is stale)
    served: dict[str, _Served] = field(default_factory=dict)


class VirtualFleet:
    def __init__(self, config: FleetConfig, stack: Stack, requests: Sequence[TraceRequest],
                 progress: Callable[[str], None]) -> None:  # fmt: skip
        if config.chunk_size % config.block_size:
            raise ValueError("chunk_size must be a multiple of block_size")
        self.config = config
        self.stack = stack
        self.requests = requests
        self.progress = progress
        self.prompts = prompt_cache(config.block_size, config.chunk_size)
        self.policy = Policy(stack.policy, default_cost_model(), config.seed)
        host_blocks = 0 if stack.connector else config.host_blocks
        self.coordinator = SimCoordinator(
            config.chunk_size, config.engines * (config.gpu_blocks + host_blocks)
        )
        ids = [f"e{i}" for i in range(config.engines)]
        self.router = EngineSet({i: f"http://{i}.virtual" for i in ids})
        kv_bytes = EngineCostModel().kv_bytes_per_token
        self.rates = TierRates(_SIM_DEFAULTS.l1_bandwidth_bytes_per_s, _SIM_DEFAULTS.l2_bandwidth_bytes_per_s,
                               _SIM_DEFAULTS.peer_bandwidth_bytes_per_s)  # fmt: skip
        self.kv_bytes_per_token = kv_bytes
        pool = SharedPool(config.l2_chunks)
        l1_chunks = config.host_blocks * config.block_size // config.chunk_size
        self.engines: list[_Engine] = []
        for engine_id in ids:
            core = EngineCore(
                BlockPool(config.gpu_blocks, config.block_size, host_blocks),
                EngineCostModel(),
                config.max_num_batched_tokens,
                config.max_num_seqs,
            )
            routed = self.router.engines[engine_id]
            routed.healthy = True
            node = None
            if stack.connector:
                node = SimNode(f"n{engine_id[1:]}", l1_chunks, pool, self.coordinator,
                               config.chunk_size * kv_bytes)  # fmt: skip
            self.engines.append(_Engine(len(self.engines), engine_id, core, routed, node))
        nodes = [e.node for e in self.engines if e.node is not None]
        for node in nodes:
            node.peers = [n for n in nodes if n is not node]
            node.announce(0.0)
        self.attached = {e.node.node_id: e.engine_id for e in self.engines if e.node is not None}
        self.peers = frozenset(self.attached)
        self.engine_ids = ids
        self.index_of = {engine_id: i for i, engine_id in enumerate(ids)}
        self.queue: list[tuple[float, int, int, int, StepOutcome | int]] = []
        self._seq = 0
        self.records: list[RequestRecord] = []
        self.now = 0.0

    # ------------------------------------------------------------------ the clock

    def _push(self, at: float, kind: int, who: int, payload: StepOutcome | int = 0) -> None:
        """``payload``: a step's outcome (``STEP_END``), a wake's generation (``WAKE``)."""
        self._seq += 1
        heapq.heappush(self.queue, (at, self._seq, kind, who, payload))

    def run(self) -> list[RequestRecord]:
        n = len(self.requests)
        for i, req in enumerate(self.requests):
            self._push(req.arrival_s / self.config.load_scale, ARRIVAL, i)
        if n:
            self._push(0.0, SCRAPE, 0)
        started = time.perf_counter()
        every = max(1, n // 20)
        while self.queue:
            at, _, kind, who, payload = heapq.heappop(self.queue)
            self.now = at
            if kind == ARRIVAL:
                self._arrive(who)
            elif kind == STEP_END:
                assert isinstance(payload, StepOutcome)
                done = len(self.records)
                self._step_end(self.engines[who], payload)
                if len(self.records) // every > done // every or len(self.records) == n:
                    self.progress(
                        f"{len(self.records)}/{n} requests, model "
                        f"{at:.0f} s, wall {time.perf_counter() - started:.1f} s"
                    )
            elif kind == WAKE:
                engine = self.engines[who]
                if not engine.busy and engine.wake == payload:
                    self._start_step(engine)
            elif len(self.records) < n:  # SCRAPE
                self._scrape()
                self._push(at + self.config.metrics_interval_s, SCRAPE, 0)
        if len(self.records) != n:
            raise RuntimeError(f"{n - len(self.records)} requests never finished")
        return sorted(self.records, key=lambda r: r.index)

    def _scrape(self) -> None:
        """The router's metrics loop: each engine's vLLM gauges as ``/metrics`` shows them."""
        for engine in self.engines:
            core = engine.core
            engine.routed.gauges = {
                VLLM_RUNNING: float(len(core.running)),
                VLLM_WAITING: float(len(core.waiting)),
                VLLM_KV_USAGE: core.pool.usage(),
            }

    # ------------------------------------------------------------------ a request

    def _arrive(self, i: int) -> None:
        trace = self.requests[i]
        prompt = self.prompts.get(trace.prompt)
        n = len(prompt.tokens)
        coverage: dict[str, Coverage] = {}
        if self.policy.uses_coverage:
            scores = self.coordinator.score(prompt.tokens, self.engine_ids, self.peers,
                                            self.attached)  # fmt: skip
            coverage = {
                s.instance_id: Coverage(s.prefix_tokens, s.fragment_tokens, s.by_tier)
                for s in scores
            }
        candidates = [
            Candidate(
                e.engine_id, self.router.load(e.routed), coverage.get(e.engine_id, NO_COVERAGE)
            )
            for e in self.engines
        ]
        choice = self.policy.rank(candidates, n)[0]
        engine = self.engines[self.index_of[choice.engine_id]]
        uncomputed = uncomputed_tokens(n, choice.coverage)
        self.router.sent(engine.routed, uncomputed)
        sim = SimRequest(str(i), prompt.tokens.tolist(), max(1, trace.output_tokens), self.now)
        sim.hashes = prompt.block_hashes()
        if engine.node is not None:
            self._ask_node(engine, sim, prompt)
        engine.served[sim.request_id] = _Served(i, uncomputed, prompt)
        engine.core.add(sim)
        if not engine.busy:
            engine.wake += 1
            self._start_step(engine)

    def _ask_node(self, engine: _Engine, sim: SimRequest, prompt: Prompt) -> None:
        """``NodeConnector.fetch``: the node's prefix, then its fragments after the longer of
        that prefix and what the engine holds itself."""
        node = engine.node
        assert node is not None
        cfg = self.config
        local = engine.core.local_prefix_of(sim.hashes, len(sim.prompt))
        prefix_sources = node.retrieve(prompt.chunk_hashes)
        start = max(sum(prefix_sources.values()) * cfg.chunk_size, local)
        fragments: list[tuple[int, int]] = []
        fragment_sources: dict[str, int] = {}
        if len(sim.prompt) - start >= cfg.chunk_size:
            fragments, fragment_sources = node.blend(prompt.tokens, start, cfg.chunk_size)
        reuse = NodeReuse.of(prefix_sources, fragments, fragment_sources, cfg.chunk_size,
                             self.kv_bytes_per_token, self.rates)  # fmt: skip
        reuse.apply_to(sim, cfg.recompute_share)

    # ------------------------------------------------------------------ an engine

    def _start_step(self, engine: _Engine) -> None:
        """``EngineDriver._run``'s loop body at model time ``now``."""
        if not engine.core.has_work():
            engine.busy = False
            return
        outcome = engine.core.step(self.now)
        who = engine.number
        if outcome.duration_s > 0.0:
            engine.busy = True
            self._push(self.now + outcome.duration_s, STEP_END, who, outcome)
            return
        engine.busy = False
        self.coordinator.engine_events(engine.engine_id, outcome.events, self.now + 1.0)
        ready = engine.core.next_ready_s()
        engine.wake += 1
        wake_at = max(ready, self.now) if ready is not None else self.now + IDLE_RETRY_S
        self._push(wake_at, WAKE, who, engine.wake)

    def _step_end(self, engine: _Engine, outcome: StepOutcome) -> None:
        self.coordinator.engine_events(engine.engine_id, outcome.events, self.now + 1.0)
        for out in outcome.outputs:
            req = out.request
            served = engine.served[req.request_id]
            if req.first_token_s is None:
                req.first_token_s = self.now
                self.router.first_byte(engine.routed, served.uncomputed)
                if engine.node is not None:
                    self._store(engine, served.prompt)
            if out.finished:
                req.finished_s = self.now
                self.router.finished(engine.routed)
                del engine.served[req.request_id]
                self.records.append(self._record(engine, served, req))
        engine.busy = False
        self._start_step(engine)

    def _store(self, engine: _Engine, prompt: Prompt) -> None:
        """``NodeConnector.store`` after the prefill: the prompt's full chunks."""
        assert engine.node is not None
        keys = self.coordinator.keys(prompt.chunk_hashes)
        engine.node.store(keys, prompt.tokens, self.config.chunk_size, self.now + 1.0)

    def _record(self, engine: _Engine, served: _Served, req: SimRequest) -> RequestRecord:
        """Reused = the prefix the engine did not compute (any tier) + the fragment tokens
        after it less their recomputed share."""
        prefix = req.num_cached_tokens or 0
        fragment = sum(max(0, s + k - max(s, prefix)) for s, k in req.fragments)
        kept = round(fragment * (1.0 - req.recompute_share))
        assert req.first_token_s is not None and req.finished_s is not None
        n = len(req.prompt)
        return RequestRecord(
            served.index, engine.engine_id, req.arrival_s, req.first_token_s, req.finished_s,
            n, min(n, prefix + kept), kept, len(req.output_ids),
        )  # fmt: skip


def run_stack(config: FleetConfig, stack: Stack, requests: Sequence[TraceRequest],
              progress: Callable[[str], None]) -> list[RequestRecord]:  # fmt: skip
    """One stack over ``requests`` from a cold start: one record per request, by index.

    The cyclic garbage collector is paused meanwhile: the directory, the engines' block maps
    and the re-keyer's chains are millions of long-lived objects that each full collection
    walks again (half the run's time), and the simulation makes no garbage cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return VirtualFleet(config, stack, requests, progress).run()
    finally:
        if enabled:
            gc.enable()
