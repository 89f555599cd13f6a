"""``kvatlas bench fleet --mode live``: one stack's replay through real processes on loopback.

Each stack gets a cold fleet of its own (:mod:`.live_fleet`): a coordinator, the engines
(``kvatlas engine-sim``), their nodes when the stack has the connector, and ``kvatlas router``.
Request ``i`` is sent to the router's ``/v1/completions`` at ``arrival_s / load_scale / speed``
wall seconds after the first (token ids, ``max_tokens`` = its output tokens, streamed with
``stream_options.include_usage``), as a client of vLLM would send it. Model time is wall time
× ``speed`` (the engines' clock), so a record's times are model seconds; its time to first
token is the first streamed token's arrival at the client, so the router's and the HTTP hops'
wall time counts too, × ``speed`` (docs/fleet-value.md measures how much).

What each request reused comes from two places, because vLLM's wire has only one of them:
``usage.prompt_tokens_details.cached_tokens`` (the prefix from the GPU, the CPU offload or the
node) per request, and, per engine, the fragment tokens its counters report (``/healthz`` →
``scheduler.fragment_tokens``; vLLM has no such field). An engine's fragment tokens less their
recompute share are apportioned over its requests by their uncached prompt tokens: a record's
share is an estimate, the sums (all the spec's JSON reports) are the engine's own counts. The
engines' counters also check the replies: an engine's prompt and cached tokens must equal the
sums over the requests it answered.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp
import httpx
import msgspec

from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.live_fleet import (
    DEFAULT_MAX_MODEL_LEN,
    MODEL,
    FleetPlan,
    LiveFleet,
    memory_dir,
    plan_fleet,
)
from kvatlas.bench.fleet.results import RequestRecord
from kvatlas.bench.fleet.stacks import Stack
from kvatlas.errors import Conflict, InvalidInput, Unavailable
from kvatlas.processes import sigterm_as_interrupt
from kvatlas.workloads import TraceRequest

PROGRESS_EVERY_S: Final = 5.0
"""Wall seconds between progress lines."""
READ_TIMEOUT_S: Final = 600.0
"""Longest wall wait between two bytes of a reply (the router's own default)."""


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: _Usage | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """One answered request as the client saw it (wall seconds since the replay began)."""

    index: int
    engine: str
    sent_s: float
    first_token_s: float
    done_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """An engine's own counters (``/healthz`` → ``scheduler``)."""

    prompt_tokens: int
    computed_prompt_tokens: int
    fragment_tokens: int
    ttft_sum_s: float
    """``vllm:time_to_first_token_seconds_sum``: the engine's own model-time TTFTs, from the
    request's arrival at the engine (after its node's answer) to its first token."""

    def minus(self, before: EngineCounts) -> EngineCounts:
        return EngineCounts(self.prompt_tokens - before.prompt_tokens,
                            self.computed_prompt_tokens - before.computed_prompt_tokens,
                            self.fragment_tokens - before.fragment_tokens,
                            self.ttft_sum_s - before.ttft_sum_s)  # fmt: skip


def run_stack(config: FleetConfig, stack: Stack, requests: Sequence[TraceRequest],
              progress: Callable[[str], None]) -> list[RequestRecord]:  # fmt: skip
    """Replay ``requests`` through a fresh live fleet of ``stack``; one record per request, in
    the workload's order."""
    if config.l2_chunks:
        raise InvalidInput("live mode: the shared L2 is an fs pool with no cap of its own "
                           "(docs/node.md); run with l2_chunks 0 (large enough)")  # fmt: skip
    if not requests:
        return []
    longest = max(r.input_tokens + max_tokens_of(r) for r in requests)
    workdir = Path(tempfile.mkdtemp(prefix=f"kvatlas-fleet-{stack.name}-"))
    l2_path = memory_dir(f"kvatlas-fleet-l2-{stack.name}-") if stack.connector else None
    plan = plan_fleet(config, stack, workdir, max(DEFAULT_MAX_MODEL_LEN, longest), l2_path)
    fleet = LiveFleet(plan, workdir, progress)
    progress(f"{config.engines} engines{' + nodes' if stack.connector else ''}, coordinator, "
             f"router (policy {stack.policy}); logs in {workdir}")  # fmt: skip
    try:
        with sigterm_as_interrupt(), fleet:
            before = engine_counts(plan)  # the warm-up's
            replies = asyncio.run(_replay(plan, fleet, config, requests, progress))
            after = engine_counts(plan)
            progress(router_line(plan))
        counts = {name: after[name].minus(before[name]) for name in after}
        records = to_records(config, requests, replies, counts)
        progress(overhead_line(records, counts))
    except KeyboardInterrupt:
        progress(f"interrupted; every process stopped; logs in {workdir}")
        raise
    except Exception:
        progress(f"failed; logs kept in {workdir}\n{fleet.tails()}")
        raise
    finally:
        if l2_path is not None:
            shutil.rmtree(l2_path, ignore_errors=True)  # the logs stay
    return records


def max_tokens_of(request: TraceRequest) -> int:
    """A trace's output length as ``max_tokens``; a request always samples one token (an
    output length of 0 in a trace is a request that produced its first token and stopped)."""
    return max(1, request.output_tokens)


def request_body(request: TraceRequest) -> bytes:
    return msgspec.json.encode({
        "model": MODEL, "prompt": request.prompt.tolist(), "max_tokens": max_tokens_of(request),
        "stream": True, "stream_options": {"include_usage": True},
    })  # fmt: skip


async def _replay(plan: FleetPlan, fleet: LiveFleet, config: FleetConfig,
                  requests: Sequence[TraceRequest], progress: Callable[[str], None]
                  ) -> list[Reply]:  # fmt: skip
    order = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    first = order[0].arrival_s
    url = f"{plan.router.url}/v1/completions"
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    done: list[Reply] = []
    sent = 0

    async def report() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            fleet.check_running()
            now = loop.time() - t0
            progress(f"sent {sent}/{len(order)}, answered {len(done)}, "
                     f"model time {now * config.speed:.0f} s")  # fmt: skip

    async def send_all(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        tasks = []
        for request in order:
            due = (request.arrival_s - first) / config.load_scale / config.speed
            if (delay := due - (loop.time() - t0)) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, request, t0, done)))
            sent += 1
        await asyncio.gather(*tasks)

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=READ_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        work = asyncio.create_task(send_all(session))
        monitor = asyncio.create_task(report())
        try:
            await asyncio.wait([work, monitor], return_when=asyncio.FIRST_COMPLETED)
            if monitor.done():
                work.cancel()
                monitor.result()  # raises why
            work.result()
        finally:
            for task in (work, monitor):
                task.cancel()
            await asyncio.gather(work, monitor, return_exceptions=True)
    wall = loop.time() - t0
    due = {r.index: (r.arrival_s - first) / config.load_scale / config.speed for r in order}
    late = max((r.sent_s - due[r.index] for r in done), default=0.0)
    progress(f"{len(done)} requests answered in {wall:.1f} s wall "
             f"({wall * config.speed:.0f} model s); the latest send "
             f"{1000 * late * config.speed:.1f} ms (model) after its arrival")  # fmt: skip
    return done


async def _one(session: aiohttp.ClientSession, url: str, request: TraceRequest, t0: float,
               done: list[Reply]) -> None:  # fmt: skip
    """Send one request; its reply's first token and closing usage, or an :class:`Unavailable`
    naming the request."""
    loop = asyncio.get_running_loop()
    body = request_body(request)
    sent = loop.time() - t0
    first: float | None = None
    usage: _Usage | None = None
    headers = {"content-type": "application/json"}
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                raise Unavailable(f"request {request.index}: HTTP {resp.status}: {text}")
            engine = resp.headers.get("x-kvatlas-engine", "")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                if first is None or b'"usage"' in payload:
                    chunk = msgspec.json.decode(payload, type=_Chunk)
                    if first is None and chunk.choices:
                        first = loop.time() - t0
                    usage = chunk.usage or usage
    except aiohttp.ClientError as exc:
        raise Unavailable(f"request {request.index}: {type(exc).__name__}: {exc}") from exc
    if first is None or usage is None:
        raise Unavailable(f"request {request.index}: the stream ended without "
                          f"{'a token' if first is None else 'its usage'}")  # fmt: skip
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    done.append(Reply(request.index, engine, sent, first, loop.time() - t0, usage.prompt_tokens,
                      cached, usage.completion_tokens))  # fmt: skip


def engine_counts(plan: FleetPlan) -> dict[str, EngineCounts]:
    out = {}
    with httpx.Client(timeout=10.0) as http:
        for engine in plan.engines:
            scheduler = http.get(f"{engine.url}/healthz").json()["scheduler"]
            metrics = http.get(f"{engine.url}/metrics").text
            out[engine.name] = EngineCounts(int(scheduler["prompt_tokens"]),
                                            int(scheduler["computed_prompt_tokens"]),
                                            int(scheduler["fragment_tokens"]),
                                            _metric_sum(metrics, TTFT_SUM))  # fmt: skip
    return out


TTFT_SUM: Final = "vllm:time_to_first_token_seconds_sum"


def _metric_sum(text: str, name: str) -> float:
    """A Prometheus text metric summed over its label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))  # fmt: skip


OVERHEAD_WARNING: Final = 0.05
"""A share of the TTFT outside the engines above which the live numbers are the machine's."""
ROUTER_COUNTERS: Final = ("kvatlas_router_score_failures_total", "kvatlas_router_retries_total")


def router_line(plan: FleetPlan) -> str:
    """Decisions the router made without a score, and retries: live artefacts when not 0."""
    text = httpx.get(f"{plan.router.url}/metrics", timeout=10.0).text
    score_failures, retries = (_metric_sum(text, name) for name in ROUTER_COUNTERS)
    return f"router score failures {score_failures:.0f}, retries {retries:.0f}"


def overhead_line(records: Sequence[RequestRecord], counts: dict[str, EngineCounts]) -> str:
    """How much of the clients' TTFT the engines did not see: the router, the HTTP hops and
    the connector's node calls, in model seconds (wall × speed)."""
    client = sum(r.ttft_s for r in records)
    engines = sum(c.ttft_sum_s for c in counts.values())
    n = max(1, len(records))
    share = (client - engines) / client if client > 0 else 0.0
    line = (f"TTFT outside the engines {1000 * (client - engines) / n:.1f} ms (model) per "
            f"request, {100 * share:.1f}% of the clients' mean TTFT {1000 * client / n:.1f} ms")  # fmt: skip
    if share > OVERHEAD_WARNING:
        line += f"; above {OVERHEAD_WARNING:.0%}: lower --speed (docs/fleet-live.md)"
    return line


def to_records(config: FleetConfig, requests: Sequence[TraceRequest], replies: Sequence[Reply],
               counts: dict[str, EngineCounts]) -> list[RequestRecord]:  # fmt: skip
    """Model-time records (wall × speed, from the first request's trace arrival), each
    engine's fragment tokens apportioned over its requests (module docstring)."""
    by_index = {r.index: r for r in requests}
    origin = min(r.arrival_s for r in requests) / config.load_scale
    by_engine: dict[str, list[Reply]] = defaultdict(list)
    for reply in replies:
        if reply.prompt_tokens != by_index[reply.index].input_tokens:
            raise Conflict(f"request {reply.index}: the engine counted {reply.prompt_tokens} "
                           f"prompt tokens of {by_index[reply.index].input_tokens}")  # fmt: skip
        by_engine[reply.engine].append(reply)
    fragments: dict[int, int] = {}
    for engine, mine in by_engine.items():
        if engine not in counts:
            raise Conflict(f"the router answered from {engine!r}, not an engine of the fleet")
        fragments.update(_apportion(engine, mine, counts[engine], config.recompute_share))

    def model_s(wall_s: float) -> float:
        return origin + wall_s * config.speed

    records = [
        RequestRecord(
            index=r.index, engine=r.engine, arrival_s=model_s(r.sent_s),
            first_token_s=model_s(r.first_token_s), finished_s=model_s(r.done_s),
            prompt_tokens=r.prompt_tokens, reused_tokens=r.cached_tokens + fragments[r.index],
            fragment_tokens=fragments[r.index], output_tokens=r.output_tokens,
        )
        for r in replies
    ]  # fmt: skip
    return sorted(records, key=lambda r: r.index)


def _apportion(engine: str, replies: Sequence[Reply], counts: EngineCounts,
               recompute_share: float) -> dict[int, int]:  # fmt: skip
    """The engine's reused fragment tokens (its count less the recompute share) split over
    its requests in proportion to their uncached prompt tokens (largest remainders: the sum
    is exact); first, its counters must agree with its replies."""
    prompt = sum(r.prompt_tokens for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    if (counts.prompt_tokens, counts.prompt_tokens - counts.computed_prompt_tokens) != (
        prompt,
        cached,
    ):
        raise Conflict(f"engine {engine} counted {counts.prompt_tokens} prompt tokens, "
                       f"{counts.prompt_tokens - counts.computed_prompt_tokens} cached; its "
                       f"replies say {prompt} and {cached}")  # fmt: skip
    total = round(counts.fragment_tokens * (1.0 - recompute_share))
    weights = [r.prompt_tokens - r.cached_tokens for r in replies]
    whole = sum(weights)
    if total == 0 or whole == 0:
        return {r.index: 0 for r in replies}
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    by_remainder = sorted(range(len(replies)), key=lambda i: -(total * weights[i] % whole))
    for i in by_remainder[:left]:
        shares[i] += 1
    return {r.index: s for r, s in zip(replies, shares, strict=True)}
