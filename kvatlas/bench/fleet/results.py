"""Per-request records → the spec's numbers and JSON (fleet-routing §4, ``--json``).

Hit ratio = prompt tokens not recomputed ÷ prompt tokens; a fragment's recomputed share counts
as recomputed (``fragment_tokens`` are the fragment tokens reused, less that share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as a stack served it (times in model seconds from the trace's start)."""

    index: int
    """The request's index in the workload (every stack sees the same indices)."""
    engine: str
    arrival_s: float
    first_token_s: float
    finished_s: float
    prompt_tokens: int
    reused_tokens: int
    """Prompt tokens not recomputed: prefix hits from any tier plus fragment tokens less
    their recomputed share."""
    fragment_tokens: int
    """Fragment tokens reused (after their recomputed share is taken off)."""
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class StackResult:
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    hit_ratio: float
    prefill_tokens: int
    """Prompt tokens recomputed."""
    fragment_tokens: int
    throughput_tokens_s: float
    """Prompt and output tokens served per model second (first arrival to last finish)."""
    requests: int

    def to_json(self) -> dict[str, float | int]:
        return {
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "hit_ratio": self.hit_ratio,
            "prefill_tokens": self.prefill_tokens,
            "fragment_tokens": self.fragment_tokens,
            "throughput_tokens_s": self.throughput_tokens_s,
            "requests": self.requests,
        }


def summarize(records: Sequence[RequestRecord]) -> StackResult:
    if not records:
        return StackResult(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0)
    ttft = np.array([r.ttft_s for r in records])
    p50, p90, p99 = (float(v) for v in np.percentile(ttft, [50, 90, 99]))
    prompt = sum(r.prompt_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)
    served = prompt + sum(r.output_tokens for r in records)
    span = max(r.finished_s for r in records) - min(r.arrival_s for r in records)
    return StackResult(
        p50,
        p90,
        p99,
        reused / prompt if prompt else 0.0,
        prompt - reused,
        sum(r.fragment_tokens for r in records),
        served / span if span > 0 else 0.0,
        len(records),
    )


@dataclass(frozen=True, slots=True)
class FleetReport:
    trace: str
    engines: int
    mode: str
    requests: int
    ceiling_hit_ratio: float
    stacks: dict[str, StackResult]

    def to_json(self) -> dict[str, Any]:
        """Exactly the spec's shape."""
        return {
            "trace": self.trace,
            "engines": self.engines,
            "mode": self.mode,
            "requests": self.requests,
            "ceiling_hit_ratio": self.ceiling_hit_ratio,
            "policies": {name: r.to_json() for name, r in self.stacks.items()},
        }
