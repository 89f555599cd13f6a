"""One fleet benchmark run: the workload, the fleet and its sizes, shared by both modes.

Every stack of a run sees the same workload, fleet and cold start. Sizes default to one
Llama-3.1-8B engine per H100 (the engine-sim cost model's defaults, docs/engine-sim.md), as
docs/fleet-value.md derives them. For a fair comparison every stack gets the same host memory
per engine: vLLM's CPU offload where the engines run alone, the node's L1 where they run with
the kvatlas connector; the L2 (a shared pool) is what only the connector stacks have.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvatlas.bench.fleet.stacks import Stack
from kvatlas.router.config import DEFAULT_METRICS_INTERVAL_S


@dataclass(frozen=True, slots=True)
class FleetConfig:
    trace: str
    """A Mooncake-format trace path or a ``rag:`` spec (kvatlas.workloads.open_workload)."""
    stacks: tuple[Stack, ...]
    engines: int = 8
    requests: int | None = None
    """The first N requests (None: all, or ``minutes``)."""
    minutes: float | None = None
    """Requests arriving in the first M minutes of the trace."""
    load_scale: float = 1.0
    """Arrivals compressed by this factor (2: twice the request rate) for a second load."""
    seed: int = 0
    speed: float = 0.25
    """live: model seconds per wall second. Every wall millisecond outside the engines'
    modelled work counts × speed, so on a busy 2-core machine live agrees with virtual only
    well below real time (docs/fleet-live.md, "Choosing the speed")."""
    block_size: int = 16
    """vLLM's default KV block."""
    gpu_blocks: int = 28_800
    """Per engine: 460,800 tokens (the spec's model: 900 blocks of 512 tokens), ≈ what an
    H100 80 GB holds for Llama-3.1-8B (0.9 × 80 GB − 16 GB weights − activations) at 128 KiB
    per token."""
    host_blocks: int = 57_600
    """Per engine, host memory for KV in blocks (≈ 120 GB): vLLM's CPU offload, or the node's
    L1 with the connector."""
    chunk_size: int = 256
    """The coordinator's and nodes' chunk (a multiple of ``block_size``)."""
    l2_chunks: int = 0
    """The connector stacks' shared L2 pool in chunks; 0: large enough for the trace."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    recompute_share: float = 0.15
    """CacheBlend's recomputed share of a reused fragment (EuroSys '25)."""
    metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S
    """How often the router scrapes the engines' gauges, in model seconds (the router's
    default). A live router scrapes on its own timer, whose phase against the trace is wherever
    the fleet's start left it; the virtual one scrapes from the trace's start. A decision that
    hinges on the gauges can then go either way (tests/bench/test_fleet_agreement.py)."""
