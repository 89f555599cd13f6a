"""Routing policies: one code path, one formula each (docs/router.md, "Policies").

Every policy turns each candidate into a **cost** (lower is better) from the same inputs —
the engine's load and, where the policy uses it, what the coordinator says the engine can
reuse — and :func:`rank` sorts by it, ties broken at random (as llm-d's max-score picker
does), so the first engine is the choice and the second the retry. No policy sees anything
another could not.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

TIERS: Final = ("gpu", "l1", "l2", "peer")
LLMD_PREFIX_WEIGHT: Final = 2.0
LLMD_KV_UTILIZATION_WEIGHT: Final = 1.0
LLMD_QUEUE_WEIGHT: Final = 1.0
LLMD_TIER_WEIGHTS: Final = {"gpu": 1.0, "l1": 0.8, "l2": 0.8, "peer": 0.0}
"""llm-d's medium weights (GPU 1.0, CPU 0.8); kvatlas's ``l1`` and ``l2`` classes are what an
engine loads through its connector — llm-d's "cpu" medium — and a peer's L1 is invisible to it."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's load as the router counts it, corrected by the engine's own metrics."""

    in_flight: int
    """Requests sent and not finished (the router's own accounting)."""
    waiting: float
    """Requests not yet prefilled: max(router's awaiting first byte, vllm:num_requests_waiting)."""
    pending_prefill_tokens: float
    """Prefill tokens still to compute: the router's own requests' uncomputed tokens, plus the
    waiting requests it did not send times the mean uncomputed prompt."""
    kv_usage: float
    """vllm:kv_cache_usage_perc (0 when never scraped)."""


@dataclass(frozen=True, slots=True)
class Coverage:
    """What an engine can reuse of the query (a ``POST /route/score`` row)."""

    prefix_tokens: int
    fragment_tokens: int
    by_tier: Mapping[str, int]


NO_COVERAGE: Final = Coverage(0, 0, dict.fromkeys(TIERS, 0))


@dataclass(frozen=True, slots=True)
class CostModel:
    """The kvatlas policy's constants (flags; sources in docs/router.md)."""

    prefill_tokens_per_s: float = 20_000.0
    kv_bytes_per_token: int = 131_072
    bandwidth_bytes_per_s: Mapping[str, float] | None = None
    """Per tier class; 0 or absent = free (KV already in the engine's GPU)."""
    recompute_share: float = 0.15
    _priced: tuple[tuple[str, float], ...] = field(default=(), init=False, repr=False,
                                                   compare=False)  # fmt: skip
    """The tiers whose fetch costs time, with their bandwidth (derived: the per-request
    loop skips the free ones)."""

    def __post_init__(self) -> None:
        bandwidths = self.bandwidth_bytes_per_s or {}
        priced = tuple((t, bw) for t in TIERS if (bw := bandwidths.get(t, 0.0)) > 0)
        object.__setattr__(self, "_priced", priced)

    def fetch_s(self, tier: str, tokens: int) -> float:
        bandwidth = (self.bandwidth_bytes_per_s or {}).get(tier, 0.0)
        return tokens * self.kv_bytes_per_token / bandwidth if bandwidth > 0 else 0.0

    def predicted_ttft_s(self, query_tokens: int, load: EngineLoad, cover: Coverage) -> float:
        """queue + prefill of what no tier supplies + fetch per tier + fragments' recompute."""
        rate = self.prefill_tokens_per_s
        reused = min(query_tokens, cover.prefix_tokens + cover.fragment_tokens)
        queue_s = load.pending_prefill_tokens / rate
        prefill_s = (query_tokens - reused) / rate
        fetch_s = 0.0  # Σ fetch_s(tier) over the priced tiers (the free ones add 0)
        for tier, bandwidth in self._priced:
            fetch_s += cover.by_tier.get(tier, 0) * self.kv_bytes_per_token / bandwidth
        recompute_s = self.recompute_share * cover.fragment_tokens / rate
        return queue_s + prefill_s + fetch_s + recompute_s


def uncomputed_tokens(prompt_tokens: int, cover: Coverage) -> int:
    """The prefill tokens a request sent with ``cover`` adds to its engine's load."""
    return max(0, prompt_tokens - (cover.prefix_tokens + cover.fragment_tokens))


@dataclass(frozen=True, slots=True)
class Candidate:
    engine_id: str
    load: EngineLoad
    coverage: Coverage = NO_COVERAGE


@dataclass(frozen=True, slots=True)
class Ranked:
    engine_id: str
    cost: float
    coverage: Coverage


def llmd_prefix_score(cover: Coverage) -> float:
    """llm-d's longest-prefix score: consecutive prefix tokens weighted by their tier. The
    prefix's tiers are the reply's ``by_tier`` less its fragments, GPU first (exact when the
    engine has no fragments; otherwise the kinder reading for this baseline)."""
    left = cover.prefix_tokens
    score = 0.0
    for tier in TIERS:
        take = min(left, cover.by_tier.get(tier, 0))
        score += take * LLMD_TIER_WEIGHTS[tier]
        left -= take
    return score


def _min_max(values: Mapping[str, float]) -> dict[str, float]:
    """llm-d's normalisation: (v - min) / (max - min), every value 1.0 when all are equal."""
    if not values:
        return {}
    low, high = min(values.values()), max(values.values())
    if high == low:
        return dict.fromkeys(values, 1.0)
    return {k: (v - low) / (high - low) for k, v in values.items()}


def prefix_costs(candidates: Sequence[Candidate]) -> dict[str, float]:
    """−(2 · prefix + 1 · (1 − KV usage) + 1 · queue), llm-d's precise-prefix-cache guide.
    The prefix scorer normalises over the engines holding any prefix (others score 0); the
    queue scorer over every candidate, fewer waiting scoring higher."""
    held = {c.engine_id: s for c in candidates if (s := llmd_prefix_score(c.coverage)) > 0}
    prefix = _min_max(held)
    queue = _min_max({c.engine_id: -c.load.waiting for c in candidates})
    return {
        c.engine_id: -(
            LLMD_PREFIX_WEIGHT * prefix.get(c.engine_id, 0.0)
            + LLMD_KV_UTILIZATION_WEIGHT * (1.0 - c.load.kv_usage)
            + LLMD_QUEUE_WEIGHT * queue[c.engine_id]
        )
        for c in candidates
    }


class Policy:
    """``rank(candidates, query_tokens)``: best first; the state of round-robin and random."""

    def __init__(self, name: str, cost_model: CostModel | None = None, seed: int = 0) -> None:
        self.name = name
        self.cost_model = cost_model or CostModel()
        self.uses_coverage = name in ("kvatlas", "prefix")
        self._rng = random.Random(seed)
        self._turn = 0

    def costs(self, candidates: Sequence[Candidate], query_tokens: int) -> dict[str, float]:
        if self.name == "kvatlas":
            model = self.cost_model
            return {
                c.engine_id: model.predicted_ttft_s(query_tokens, c.load, c.coverage)
                for c in candidates
            }
        if self.name == "prefix":
            return prefix_costs(candidates)
        if self.name == "least-loaded":
            return {
                c.engine_id: c.load.in_flight + c.load.waiting + c.load.kv_usage for c in candidates
            }
        if self.name == "round-robin":
            n = len(candidates)
            start, self._turn = self._turn % max(n, 1), self._turn + 1
            return {c.engine_id: float((i - start) % n) for i, c in enumerate(candidates)}
        if self.name == "random":
            return {c.engine_id: self._rng.random() for c in candidates}
        raise ValueError(f"unknown policy {self.name!r}")

    def rank(self, candidates: Sequence[Candidate], query_tokens: int) -> list[Ranked]:
        costs = self.costs(candidates, query_tokens)
        ties = {c.engine_id: self._rng.random() for c in candidates}
        ordered = sorted(candidates, key=lambda c: (costs[c.engine_id], ties[c.engine_id]))
        return [Ranked(c.engine_id, costs[c.engine_id], c.coverage) for c in ordered]
