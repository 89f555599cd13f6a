"""Fleet eviction policies replayed through a Mooncake trace under per-salt quotas: hit ratio
(chunks and tokens), prefill tokens saved and bytes evicted for each policy at each quota.

The fleet cache holds each complete 512-token block of the trace once per salt (a fleet-wide
pool; which instance holds it does not change what a quota keeps). A request reuses the longest
run of its leading blocks the cache holds (prefix reuse, as LMCache's lookup stops at the first
miss), then every complete block it has is stored or touched (a ``store`` or ``access`` event:
last access = its arrival; every key counts one access, as the directory, which keeps no
count per key, gives the coordinator's loop). Every ``--pass-interval-s`` of trace time the
planner of ``kvatlas.coordinator.cache_control.eviction`` runs over every salt and its plan is
applied at once. Tenants: a trace has none, so requests are split into ``--salts`` salts by
the first block after the prefix every request shares (a shared system prompt is each
tenant's own copy), a request with no block after it by its index in the trace (a Mooncake
trace names no session); each salt's quota is a fraction of its own working set (its distinct
complete blocks). Rows marked "ablation" attribute the value policy's result: LRU order with
the value policy's amount (evict to the limit), and value without the position term.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import numpy as np
from rich.console import Console
from rich.table import Table

from kvatlas.bench.common import progress, refuse
from kvatlas.coordinator.cache_control.eviction import (
    DEFAULT_POLICY,
    EvictionConfig,
    EvictionPolicy,
    SaltState,
    lru_order,
    plan_salt,
    take_until,
    triggered,
)
from kvatlas.errors import InvalidInput
from kvatlas.workloads import BLOCK_SPAN, read_mooncake

QUICK_REQUESTS: Final = 200
LLAMA3_8B_BYTES_PER_TOKEN: Final = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, bf16
Planner = Callable[[SaltState[int], float], np.ndarray]  # the rows a pass evicts


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    salt: int
    slots: np.ndarray  # int64: the salt's slot of each complete block, in prompt order
    input_tokens: int


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[Request, ...]
    salts: int
    slots_per_salt: tuple[int, ...]  # distinct complete blocks of each salt (its working set)
    positions: tuple[np.ndarray, ...]  # each salt's slot → the block's index in its prompt


@dataclass(frozen=True, slots=True)
class Outcome:
    policy: str
    quota: float
    chunk_hit_ratio: float
    token_hit_ratio: float
    prefill_tokens_saved: int
    bytes_evicted: int
    keys_evicted: int
    mean_usage_of_limit: float  # at each pass, before it evicts
    peak_usage_of_limit: float
    seconds: float


def _salt_of(value: int, salts: int) -> int:
    """A salt for a tenant's first own block (or a request's index): a multiplicative hash,
    spread over ``salts``."""
    return (((value * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 40) % salts


def load_trace(path: Path, salts: int, limit: int | None) -> Trace:
    """The trace's requests as slot numbers per salt (complete blocks only)."""
    raw: list[tuple[int, float, list[int], int]] = []
    for request in read_mooncake(path, limit):
        blocks = [int(s.split(":")[1]) for s, _, length in request.segments
                  if length == BLOCK_SPAN]  # fmt: skip
        raw.append((request.index, request.arrival_s, blocks, request.input_tokens))
    if not raw:
        raise InvalidInput(f"{path}: no requests")
    common = raw[0][2]
    for _, _, blocks, _ in raw:
        n = 0
        while n < min(len(common), len(blocks)) and common[n] == blocks[n]:
            n += 1
        common = common[:n]
    slot_of: list[dict[int, int]] = [{} for _ in range(salts)]
    position_of: list[list[int]] = [[] for _ in range(salts)]
    requests = []
    for index, arrival_s, blocks, tokens in raw:
        # the tenant's first own block; a request with none (only the shared prefix): its index
        own = len(blocks) > len(common)
        salt = _salt_of(blocks[len(common)] + 1, salts) if own else _salt_of(index, salts)
        slots = []
        for position, block in enumerate(blocks):
            slot = slot_of[salt].setdefault(block, len(slot_of[salt]))
            if slot == len(position_of[salt]):
                position_of[salt].append(position)
            slots.append(slot)
        requests.append(Request(arrival_s, salt, np.array(slots, dtype=np.int64), tokens))
    return Trace(tuple(requests), salts, tuple(len(s) for s in slot_of),
                 tuple(np.array(p, dtype=np.int64) for p in position_of))  # fmt: skip


def planners(config: EvictionConfig) -> dict[str, Planner]:
    """The policies compared, by row name; ablations are labelled so."""

    def policy(p: EvictionPolicy, c: EvictionConfig) -> Planner:
        def rows(state: SaltState[int], now_s: float) -> np.ndarray:
            eviction = plan_salt(p, state, now_s, c)
            return np.array(eviction.rows if eviction else (), dtype=np.int64)

        return rows

    def lru_to_limit(state: SaltState[int], now_s: float) -> np.ndarray:
        if not triggered(state, config):
            return np.zeros(0, dtype=np.int64)
        assert state.limit_bytes is not None
        return take_until(state, lru_order(state), config.watermark * state.limit_bytes)

    no_position = EvictionConfig(config.watermark, config.ratio, config.pass_interval_s,
                                 config.chunk_tokens, math.inf)  # fmt: skip
    return {
        "lru": policy(EvictionPolicy.LRU, config),
        "value": policy(EvictionPolicy.VALUE, config),
        "ablation: lru order, evict to the limit": lru_to_limit,
        "ablation: value without position": policy(EvictionPolicy.VALUE, no_position),
    }


def simulate(trace: Trace, quota: float, planner: Planner, config: EvictionConfig,
             block_bytes: int, name: str) -> Outcome:  # fmt: skip
    """Replay the trace through a fleet cache whose salts each have ``quota`` x their working
    set as limit, running ``planner`` every pass interval."""
    started = time.perf_counter()
    present = [np.zeros(n, dtype=bool) for n in trace.slots_per_salt]
    last = [np.zeros(n, dtype=np.float64) for n in trace.slots_per_salt]
    touched = [np.zeros(n, dtype=np.int64) for n in trace.slots_per_salt]  # touch sequence
    usage = [0] * trace.salts
    limits = [int(quota * n * block_bytes) for n in trace.slots_per_salt]
    sizes = [np.full(n, block_bytes, dtype=np.int64) for n in trace.slots_per_salt]
    no_pins = [np.zeros(n, dtype=bool) for n in trace.slots_per_salt]
    sequence = 0
    hit_chunks = chunks = hit_tokens = tokens = 0
    evicted_bytes = evicted_keys = 0
    usage_samples: list[float] = []

    def run_pass(now_s: float) -> None:
        nonlocal evicted_bytes, evicted_keys
        for salt in range(trace.salts):
            if not limits[salt]:
                continue
            usage_samples.append(usage[salt] / limits[salt])
            rows = np.flatnonzero(present[salt])
            rows = rows[np.argsort(touched[salt][rows], kind="stable")]
            # one access per key, as the directory gives the loop (it counts none per key)
            state = SaltState(f"t{salt}", usage[salt], limits[salt], rows.tolist(),
                              sizes[salt][rows], last[salt][rows], np.ones(len(rows), np.int64),
                              trace.positions[salt][rows], no_pins[salt][rows])  # fmt: skip
            if not triggered(state, config):
                continue
            victims = rows[planner(state, now_s)]
            present[salt][victims] = False
            freed = int(sizes[salt][victims].sum())
            usage[salt] -= freed
            evicted_bytes += freed
            evicted_keys += len(victims)

    next_pass = config.pass_interval_s
    for request in trace.requests:
        while next_pass <= request.arrival_s:
            run_pass(next_pass)
            next_pass += config.pass_interval_s
        salt, slots = request.salt, request.slots
        held = present[salt][slots]
        reused = len(slots) if held.all() else int(np.argmin(held))
        hit_chunks += reused
        chunks += len(slots)
        hit_tokens += reused * BLOCK_SPAN
        tokens += request.input_tokens
        new = slots[~held]
        present[salt][new] = True
        usage[salt] += int(sizes[salt][new].sum())
        last[salt][slots] = request.arrival_s
        touched[salt][slots] = np.arange(sequence, sequence + len(slots))
        sequence += len(slots)
    return Outcome(
        policy=name,
        quota=quota,
        chunk_hit_ratio=hit_chunks / chunks if chunks else 0.0,
        token_hit_ratio=hit_tokens / tokens if tokens else 0.0,
        prefill_tokens_saved=hit_tokens,
        bytes_evicted=evicted_bytes,
        keys_evicted=evicted_keys,
        mean_usage_of_limit=float(np.mean(usage_samples)) if usage_samples else 0.0,
        peak_usage_of_limit=max(usage_samples, default=0.0),
        seconds=time.perf_counter() - started,
    )


def winner(outcomes: Sequence[Outcome]) -> str:
    """The policy (of ``lru`` and ``value``) that saves more prefill tokens summed over the
    quotas (the mean token hit ratio: one trace); LRU, LMCache's, when equal."""
    saved = {"lru": 0, "value": 0}
    for o in outcomes:
        if o.policy in saved:
            saved[o.policy] += o.prefill_tokens_saved
    return "value" if saved["value"] > saved["lru"] else "lru"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=None,
                        help="a Mooncake-format trace (JSONL; required), e.g. the synthetic "
                             "trace of shared/traces/")  # fmt: skip
    parser.add_argument("--quotas", default="0.25,0.5,0.75",
                        help="each salt's limit as fractions of its working set (comma-separated)")  # fmt: skip
    parser.add_argument("--salts", type=int, default=4, help="tenants the requests are split into")
    parser.add_argument("--requests", type=int, default=None, help="the first N requests only")
    parser.add_argument("--bytes-per-token", type=int, default=LLAMA3_8B_BYTES_PER_TOKEN,
                        help="KV bytes per token (default: Llama-3-8B in bf16, 131072)")  # fmt: skip
    parser.add_argument("--chunk-tokens", type=int, default=BLOCK_SPAN,
                        help="tokens per chunk for the value policy's position term (the "
                             "trace's 512-token blocks)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke size: the first {QUICK_REQUESTS} requests, quota 0.5")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    try:
        quotas = [float(q) for q in ("0.5" if args.quick else args.quotas).split(",")]
    except ValueError:
        return refuse("eviction", f"--quotas must be numbers, got {args.quotas!r}")
    if any(not 0.0 < q < 1.0 for q in quotas) or args.salts < 1 or args.bytes_per_token < 1:
        return refuse("eviction", "quotas must be in (0, 1); --salts and --bytes-per-token ≥ 1")
    if args.trace is None:
        return refuse("eviction", "--trace is required (a Mooncake-format JSONL trace)")
    limit = QUICK_REQUESTS if args.quick else args.requests
    try:
        trace = load_trace(args.trace, args.salts, limit)
    except (InvalidInput, OSError) as exc:
        return refuse("eviction", str(exc))
    per_salt = np.bincount([r.salt for r in trace.requests], minlength=trace.salts).tolist()
    progress("eviction", f"{len(trace.requests)} requests ({', '.join(map(str, per_salt))} "
                         f"by salt), {sum(trace.slots_per_salt)} distinct blocks in "
                         f"{trace.salts} salts")  # fmt: skip
    config = EvictionConfig(chunk_tokens=args.chunk_tokens)
    block_bytes = BLOCK_SPAN * args.bytes_per_token
    outcomes = []
    for quota in quotas:
        for name, planner in planners(config).items():
            outcome = simulate(trace, quota, planner, config, block_bytes, name)
            progress("eviction", f"quota {quota:.0%}, {name}: token hit ratio "
                                 f"{outcome.token_hit_ratio:.2%} ({outcome.seconds:.1f} s)")  # fmt: skip
            outcomes.append(outcome)
    keep_all: Planner = lambda state, now_s: np.zeros(0, dtype=np.int64)  # noqa: E731
    ceiling = simulate(trace, 2.0, keep_all, config, block_bytes, "no quota")
    best = winner(outcomes)
    load = os.getloadavg()
    _print(trace, outcomes, ceiling, best, load, args.trace)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "trace": str(args.trace), "requests": len(trace.requests), "salts": trace.salts,
            "requests_per_salt": per_salt,
            "working_set_blocks": sum(trace.slots_per_salt), "block_bytes": block_bytes,
            "ceiling": asdict(ceiling), "outcomes": [asdict(o) for o in outcomes],
            "winner": best, "default_policy": DEFAULT_POLICY.value,
            "load_average": list(load), "cores": os.cpu_count(),
        }, indent=2))  # fmt: skip
    return 0


def _print(trace: Trace, outcomes: Sequence[Outcome], ceiling: Outcome, best: str,
           load: tuple[float, float, float], path: Path) -> None:  # fmt: skip
    table = Table(title=f"fleet eviction: {path.name}, {len(trace.requests)} requests, "
                        f"{trace.salts} salts")  # fmt: skip
    for column in ("quota", "policy", "chunk hits", "token hits", "prefill tokens saved",
                   "GiB evicted", "keys evicted", "usage/limit mean", "peak"):  # fmt: skip
        table.add_column(column)
    for o in [*outcomes, ceiling]:
        table.add_row(
            "∞" if o is ceiling else f"{o.quota:.0%}",
            o.policy,
            f"{o.chunk_hit_ratio:.2%}",
            f"{o.token_hit_ratio:.2%}",
            f"{o.prefill_tokens_saved:,}",
            f"{o.bytes_evicted / (1 << 30):,.1f}",
            f"{o.keys_evicted:,}",
            f"{o.mean_usage_of_limit:.2f}" if o is not ceiling else "-",
            f"{o.peak_usage_of_limit:.2f}" if o is not ceiling else "-",
        )
    Console(width=max(Console().width, 150)).print(table)
    print(
        f"winner (prefill tokens saved over the quotas): {best}; default policy: "
        f"{DEFAULT_POLICY.value}; load average {load[0]:.1f} on {os.cpu_count()} cores"
    )
