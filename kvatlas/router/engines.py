"""The engines behind the router: who they are, whether they answer, and how loaded they are.

Invariant: an engine is a candidate only while healthy — its last ``/health`` answered 200
and nothing since refused a connection. A refusal takes it out at once; only a later health
check brings it back. Load is the router's own accounting (requests in flight, those still
waiting for their first byte and their uncomputed prefill tokens), corrected by the engine's
vLLM gauges, scraped at an interval: requests other clients sent show up there and nowhere
else. Everything here runs on the router's event loop: no locks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.api import InstanceRow
from kvatlas.checks import has_userinfo
from kvatlas.router.policies import EngineLoad

log = logging.getLogger(__name__)

VLLM_RUNNING: Final = "vllm:num_requests_running"
VLLM_WAITING: Final = "vllm:num_requests_waiting"
VLLM_KV_USAGE: Final = "vllm:kv_cache_usage_perc"
_GAUGES: Final = (VLLM_RUNNING, VLLM_WAITING, VLLM_KV_USAGE)


@dataclass
class Engine:
    """One engine's state (mutated on the event loop only)."""

    engine_id: str
    url: str
    from_coordinator: bool = False
    healthy: bool = False
    models: dict[str, int | None] | None = None
    """Served model → max_model_len (``None`` until ``/v1/models`` answered)."""
    logged_healthy: bool | None = None
    """The health last logged (``None``: none yet): a change is logged once, not every probe."""
    in_flight: int = 0
    awaiting_first_byte: int = 0
    pending_tokens: int = 0
    gauges: dict[str, float] = field(default_factory=dict)

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def max_model_len(self, model: str) -> int | None:
        return None if self.models is None else self.models.get(model)

    def fits(self, model: str, prompt_tokens: int, max_tokens: int | None) -> bool:
        """vLLM 0.33's check: a prompt that leaves room for an output token and an output limit
        within the context (a limit past what the prompt leaves is cut to it, ``get_max_tokens``,
        not refused)."""
        limit = self.max_model_len(model)
        if limit is None:
            return True
        return prompt_tokens < limit and (max_tokens is None or max_tokens <= limit)


def parse_vllm_gauges(text: str) -> dict[str, float]:
    """vLLM's three load gauges from a Prometheus exposition, summed over label sets (one per
    model / data-parallel rank); usage is averaged instead. Other metrics are ignored."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _GAUGES and math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                counts[sample.name] = counts.get(sample.name, 0) + 1
    if VLLM_KV_USAGE in sums:
        sums[VLLM_KV_USAGE] /= counts[VLLM_KV_USAGE]
    return sums


def parse_models(payload: Any) -> dict[str, int | None]:
    """``GET /v1/models`` → ``{id: max_model_len}`` (vLLM states ``max_model_len``)."""
    rows = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(rows, list):
        raise ValueError("no 'data' list")
    models: dict[str, int | None] = {}
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            length = row.get("max_model_len")
            models[row["id"]] = length if isinstance(length, int) and length > 0 else None
    return models


class EngineSet:
    """The engines, their health and their load."""

    def __init__(self, engines: Mapping[str, str]) -> None:
        self.http: aiohttp.ClientSession | None = None
        """The probes' session (made on the router's event loop when it starts)."""
        self.engines: dict[str, Engine] = {i: Engine(i, url) for i, url in engines.items()}
        self._fixed = set(engines)
        self.mean_prompt_tokens = 0.0
        """Running mean of the uncomputed prefill tokens per request (for foreign waiters)."""

    # ------------------------------------------------------------------ membership

    def merge_listed(self, listed: Mapping[str, str]) -> None:
        """Engines the coordinator lists now (``--engines-from-coordinator``); ``--engine``
        entries stay as given; listed ones that vanished go once idle."""
        for engine_id, url in listed.items():
            if engine_id in self._fixed:
                continue
            known = self.engines.get(engine_id)
            if known is None or known.url != url:
                self.engines[engine_id] = Engine(engine_id, url, from_coordinator=True)
        for engine_id in [i for i, e in self.engines.items() if e.from_coordinator]:
            if engine_id not in listed and self.engines[engine_id].in_flight == 0:
                del self.engines[engine_id]

    def healthy(self) -> list[Engine]:
        return [self.engines[i] for i in sorted(self.engines) if self.engines[i].healthy]

    def out_of_set(self) -> int:
        return sum(1 for e in self.engines.values() if not e.healthy)

    # ------------------------------------------------------------------ load

    def load(self, engine: Engine) -> EngineLoad:
        running = engine.gauges.get(VLLM_RUNNING, 0.0)
        waiting_metric = engine.gauges.get(VLLM_WAITING, 0.0)
        foreign_waiting = max(0.0, waiting_metric - engine.awaiting_first_byte)
        return EngineLoad(
            in_flight=max(engine.in_flight, int(running + waiting_metric)),
            waiting=max(float(engine.awaiting_first_byte), waiting_metric),
            pending_prefill_tokens=engine.pending_tokens
            + foreign_waiting * self.mean_prompt_tokens,
            kv_usage=min(1.0, max(0.0, engine.gauges.get(VLLM_KV_USAGE, 0.0))),
        )

    def sent(self, engine: Engine, uncomputed_tokens: int) -> None:
        engine.in_flight += 1
        engine.awaiting_first_byte += 1
        engine.pending_tokens += uncomputed_tokens
        self.mean_prompt_tokens += (uncomputed_tokens - self.mean_prompt_tokens) * 0.05

    def first_byte(self, engine: Engine, uncomputed_tokens: int) -> None:
        engine.awaiting_first_byte -= 1
        engine.pending_tokens -= uncomputed_tokens

    def finished(self, engine: Engine) -> None:
        engine.in_flight -= 1

    def refused(self, engine: Engine) -> None:
        if engine.healthy:
            log.warning(
                "engine %s refused a connection: out of the set until healthy", engine.engine_id
            )
            engine.logged_healthy = False  # (said: the health checks that fail say no more)
        engine.healthy = False

    # ------------------------------------------------------------------ probes

    async def _get(self, url: str) -> tuple[int, bytes]:
        if self.http is None:
            raise RuntimeError("EngineSet.http is set when the router starts")
        async with self.http.get(url) as reply:
            return reply.status, await reply.read()

    async def check(self, engine: Engine) -> None:
        """``/health`` then ``/v1/models``; either failing takes the engine out. Each change is
        logged once: a WARNING with the reason when the engine goes out (or is out from its
        first check), an INFO when it is healthy again (or from the first); a probe that fails
        like the one before is logged at DEBUG only."""
        try:
            reason = await self._probe(engine)
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        ok = reason is None
        if ok != engine.logged_healthy:
            engine.logged_healthy = ok
            if ok:
                log.info("engine %s (%s) is healthy: in the set", engine.engine_id, engine.url)
            else:
                log.warning("engine %s (%s) is unhealthy, out of the set until a health check "
                            "passes: %s", engine.engine_id, engine.url, reason)  # fmt: skip
        elif reason is not None:
            log.debug("engine %s: health check failed: %s", engine.engine_id, reason)
        engine.healthy = ok

    async def _probe(self, engine: Engine) -> str | None:
        """Why ``engine`` is not healthy (``None``: it is; its models are read)."""
        status, _ = await self._get(f"{engine.url}/health")
        if status != 200:
            return f"GET /health answered {status}"
        status, raw = await self._get(f"{engine.url}/v1/models")
        if status != 200:
            return f"GET /v1/models answered {status}"
        try:
            engine.models = parse_models(msgspec.json.decode(raw))
        except ValueError as exc:  # (msgspec.DecodeError is one)
            return f"GET /v1/models: not vLLM's model list ({exc})"
        return None

    async def scrape(self, engine: Engine) -> None:
        try:
            status, raw = await self._get(f"{engine.url}/metrics")
            if status == 200:
                engine.gauges = parse_vllm_gauges(raw.decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("engine %s: metrics scrape failed: %s", engine.engine_id, exc)

    def all(self) -> Iterable[Engine]:
        return list(self.engines.values())


def listed_engines(rows: Sequence[InstanceRow], template: str | None) -> dict[str, str]:
    """The coordinator's instances with a URL to reach them (``--engines-from-coordinator``):
    ``metadata.openai_url``, else ``template`` (``--engine-url-template``). A node that serves
    an engine (its row names an ``engine_id``) is not one: its copies are scored as its
    engine's, which is routed by its own id."""
    found: dict[str, str] = {}
    for row in rows:
        if isinstance(row.engine_id, str) and row.engine_id:
            continue
        engine_id = row.instance_id
        url = row.meta.get("openai_url")
        if not isinstance(url, str) and template:
            url = template.format(instance_id=engine_id)
        if (
            isinstance(url, str)
            and url.startswith(("http://", "https://"))
            and not has_userinfo(url)  # (it would show on /healthz: check_http_url)
        ):
            found[engine_id] = url.rstrip("/")
    return found
