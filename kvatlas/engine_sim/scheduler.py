"""Continuous batching as vLLM's v1 scheduler does it, on the model clock.

Each step first serves the running requests (a decode token each, or the next chunk of a long
prefill), then admits waiting requests first come first served while the step's token budget,
the sequence cap and the free blocks allow (chunked prefill: a prompt longer than the budget is
computed over several steps). Admission looks up the longest cached prefix (GPU blocks, then
the CPU tier's continuation, which is loaded before the request may run); at most all but the
last prompt token can be reused, as in vLLM, so a request always computes one token. A running
request that cannot get a block preempts the most recently admitted one (vLLM's recompute
preemption). A request samples a token at the end of every step that leaves it fully computed.
The core is pure (no clock, no I/O): the server and a discrete-event benchmark drive it alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvatlas.engine_sim.block_hash import block_hashes, salt_keys
from kvatlas.engine_sim.cost_model import CostModel
from kvatlas.engine_sim.kv_cache import BlockPool
from kvatlas.events.vllm_wire import KVEvent

FINISH_LENGTH: Final = "length"
FINISH_STOP: Final = "stop"
FINISH_ABORT: Final = "abort"


@dataclass(slots=True, eq=False)  # identity: lists of requests are searched on every step
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float
    cache_salt: str | None = None
    finish_reason_at_max: str = FINISH_LENGTH
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    cached_blocks: int = 0  # blocks of this request already in the pool's cache
    num_computed: int = 0
    num_cached_tokens: int | None = None  # set at first admission (usage.cached_tokens)
    looked_up: bool = False  # the cache was consulted since the last (re)admission
    gpu_hit_blocks: int = 0  # what that lookup found
    cpu_hit_blocks: int = 0
    node_hit_blocks: int = 0
    # what a kvatlas node supplies (the connector asks before the request is added): a prefix
    # and its load time; fragments (start, length) after it, their load time, and the share of
    # a fragment's tokens that is still computed
    node_prefix_tokens: int = 0
    node_prefix_load_s: float = 0.0
    fragments: tuple[tuple[int, int], ...] = ()
    fragment_load_s: float = 0.0
    recompute_share: float = 1.0
    ready_s: float = 0.0  # CPU-tier blocks loaded by then
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output_ids[i - n]

    def tokens(self) -> list[int]:
        return self.prompt + self.output_ids


@dataclass(frozen=True, slots=True)
class TokenOutput:
    request: SimRequest
    token_id: int
    finished: bool


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step did: its duration (0: nothing could run), the tokens sampled at its end,
    the requests it preempted and the KV events it caused."""

    duration_s: float
    outputs: list[TokenOutput]
    events: list[KVEvent]
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass(slots=True)
class SchedulerCounts:
    prefix_queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    prefix_hits: int = 0  # of them found on the GPU (vLLM's prefix_cache_hits)
    cpu_hit_tokens: int = 0  # found in the CPU tier (vLLM: external hits)
    node_hit_tokens: int = 0  # the kvatlas node's prefix (vLLM: external hits too)
    fragment_tokens: int = 0  # reused at other offsets through the node (partly recomputed)
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


class EngineCore:
    def __init__(self, pool: BlockPool, cost: CostModel, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256, output_vocab: Sequence[int] = range(128_256)
                 ) -> None:  # fmt: skip
        self.pool = pool
        self.cost = cost
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.output_vocab = output_vocab
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counts = SchedulerCounts()

    # ------------------------------------------------------------------ requests in and out

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            self._free(request)
        request.finish_reason = request.finish_reason or FINISH_ABORT

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_ready_s(self) -> float | None:
        """When the earliest request still loading from the CPU tier may run."""
        pending = [r.ready_s for r in self.waiting if r.looked_up]
        return min(pending) if pending else None

    def local_prefix(self, req: SimRequest) -> int:
        """What the GPU and the CPU tier hold of ``req``'s prompt from the start (no change
        made but its block hashes, computed once here and kept for its admission)."""
        self._extend_hashes(req)
        return self.local_prefix_of(req.hashes, len(req.prompt))

    def local_prefix_of(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """What the GPU and the CPU tier hold of a prompt ``num_tokens`` long, from its block
        hashes."""
        hashes = hashes[: (num_tokens - 1) // self.block_size]
        gpu = len(self.pool.cached_prefix(hashes))
        return (gpu + self.pool.cpu_run(hashes, gpu)) * self.block_size

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    # ------------------------------------------------------------------ one step

    def step(self, now_s: float) -> StepOutcome:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted by an earlier one this step
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n, scheduled):
                continue
            scheduled.append((req, n))
            budget -= n
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if not req.looked_up:
                self._lookup(req, now_s)
            if req.ready_s > now_s:  # still loading from the CPU tier
                skipped.append(req)
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.blocks_needed(req.num_computed + n) - len(req.block_ids)
            got = self.pool.allocate(need) if need > 0 else []
            if got is None:
                # Waiting requests hold nothing once loaded (what they reused stays cached,
                # found again at their turn): else the head could wait forever on blocks held
                # by requests queued behind it.
                self._reset(req)
                for other in self.waiting:
                    if other.block_ids and other.ready_s <= now_s:
                        self._reset(other)
                self.waiting.appendleft(req)
                break
            req.block_ids += got
            if req.num_cached_tokens is None:
                self._admitted(req)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return self._run(scheduled)

    def _lookup(self, req: SimRequest, now_s: float) -> None:
        """Reuse the cached prefix (GPU, then CPU, then the kvatlas node), as vLLM's
        ``get_computed_blocks`` and its connector's lookup; what is loaded goes into fresh GPU
        blocks (cached there), and the request waits for the loads before it runs."""
        bs = self.block_size
        self._extend_hashes(req)
        limit = (req.num_tokens - 1) // bs  # never reuse the whole prompt
        gpu = self.pool.cached_prefix(req.hashes[:limit])
        self.pool.touch(gpu)
        req.block_ids = list(gpu)
        req.cached_blocks = len(gpu)
        ready = now_s
        cpu = min(self.pool.cpu_run(req.hashes, len(gpu)), limit - len(gpu))
        if cpu and self._load(req, cpu):
            for h in req.hashes[len(gpu) : len(gpu) + cpu]:
                self.pool.cpu.touch(h)
            ready += self.cost.cpu_load_seconds(cpu * bs)
            self.pool.counts.cpu_loads += cpu
        else:
            cpu = 0
        local = len(gpu) + cpu
        node = max(0, min(req.node_prefix_tokens // bs, limit) - local)
        if node and self._load(req, node):
            ready += req.node_prefix_load_s * node * bs / req.node_prefix_tokens
        else:
            node = 0
        if req.fragments:
            ready += req.fragment_load_s
        req.ready_s = ready
        req.num_computed = (local + node) * bs
        req.gpu_hit_blocks, req.cpu_hit_blocks, req.node_hit_blocks = len(gpu), cpu, node
        req.looked_up = True

    def _load(self, req: SimRequest, n: int) -> bool:
        """``n`` more blocks loaded from outside the GPU into fresh blocks, cached there."""
        got = self.pool.allocate(n)
        if got is None:
            return False
        req.block_ids += got
        self._cache(req, len(req.block_ids))
        return True

    def _admitted(self, req: SimRequest) -> None:
        """First scheduled: what it reused is what ``usage.cached_tokens`` reports."""
        bs = self.block_size
        req.num_cached_tokens = req.num_computed
        self.counts.prefix_queries += len(req.prompt)
        self.counts.prefix_hits += req.gpu_hit_blocks * bs
        self.counts.cpu_hit_tokens += req.cpu_hit_blocks * bs
        self.counts.node_hit_tokens += req.node_hit_blocks * bs
        self.counts.fragment_tokens += sum(
            max(0, start + n - max(start, req.num_computed)) for start, n in req.fragments
        )
        self.counts.prompt_tokens += len(req.prompt)
        self.counts.computed_prompt_tokens += len(req.prompt) - req.num_computed

    def _grow(self, req: SimRequest, n: int, scheduled: list[tuple[SimRequest, int]]) -> bool:
        """Blocks for ``n`` more tokens of a running request, preempting the most recently
        admitted others if needed; False if ``req`` itself was preempted."""
        need = self.blocks_needed(req.num_computed + n) - len(req.block_ids)
        while need > 0:
            got = self.pool.allocate(need)
            if got is not None:
                req.block_ids += got
                return True
            victim = self.running[-1]
            self._preempt(victim, scheduled)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SimRequest, scheduled: list[tuple[SimRequest, int]]) -> None:
        self.running.remove(req)
        for i, (r, _) in enumerate(scheduled):
            if r is req:
                del scheduled[i]
                break
        self._reset(req)
        self.waiting.appendleft(req)
        self.counts.preemptions += 1

    def _reset(self, req: SimRequest) -> None:
        """Back to nothing computed and no blocks held; the next admission looks up again."""
        self._free(req)
        req.num_computed = 0
        req.cached_blocks = 0
        req.ready_s = 0.0
        req.looked_up = False

    def _free(self, req: SimRequest) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []

    def _extend_hashes(self, req: SimRequest) -> None:
        full = req.num_tokens // self.block_size
        if full > len(req.hashes):
            start = len(req.hashes)
            parent = req.hashes[-1] if req.hashes else None
            req.hashes += block_hashes(req.tokens(), self.block_size, req.cache_salt, start, parent)

    def _cache(self, req: SimRequest, full: int) -> None:
        if full <= req.cached_blocks:
            return
        self._extend_hashes(req)
        extra: list[list[Any] | None] = [None] * full
        if salt_keys(req.cache_salt):
            extra[0] = [req.cache_salt]
        # (a prefill chunk's blocks are all prompt: no copy of prompt + output per step)
        tokens = req.prompt if full * self.block_size <= len(req.prompt) else req.tokens()
        self.pool.cache(req.block_ids, req.hashes, req.cached_blocks, full, tokens, extra)
        req.cached_blocks = full

    def _run(self, scheduled: list[tuple[SimRequest, int]]) -> StepOutcome:
        if not scheduled:
            return StepOutcome(0.0, [], self.pool.take_events())
        prefill = prefill_ctx = decode = decode_ctx = 0
        for req, n in scheduled:
            if n == 1 and req.output_ids:
                decode += 1
                decode_ctx += req.num_tokens
                continue
            # fragment tokens are loaded, not computed, but for their recompute share
            scale = 1.0 - (1.0 - req.recompute_share) * self._fragment_overlap(req, n) / n
            prefill += round(n * scale)
            prefill_ctx += round((n * req.num_computed + n * (n + 1) // 2) * scale)
        duration = self.cost.step_seconds(prefill, prefill_ctx, decode, decode_ctx)
        outputs: list[TokenOutput] = []
        for req, n in scheduled:
            req.num_computed += n
            self._cache(req, req.num_computed // self.block_size)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk: no token yet
            token = self.output_token(req, len(req.output_ids))
            req.output_ids.append(token)
            self.counts.generation_tokens += 1
            done = len(req.output_ids) >= req.max_tokens
            if done:
                req.finish_reason = req.finish_reason_at_max
                self.running.remove(req)
                self._free(req)
            outputs.append(TokenOutput(req, token, done))
        self.counts.steps += 1
        return StepOutcome(duration, outputs, self.pool.take_events(), prefill, decode)

    @staticmethod
    def _fragment_overlap(req: SimRequest, n: int) -> int:
        lo, hi = req.num_computed, req.num_computed + n
        return sum(max(0, min(hi, s + k) - max(lo, s)) for s, k in req.fragments)

    def output_token(self, req: SimRequest, i: int) -> int:
        """An arbitrary but deterministic output token: the same prompt gives the same output
        (as greedy decoding does), so repeated conversations share their blocks."""
        seed = req.hashes[0][0] if req.hashes else len(req.prompt)
        vocab = self.output_vocab
        return vocab[(seed * 7919 + len(req.prompt) * 31 + i * 104_729) % len(vocab)]
