"""The router's HTTP surface: an OpenAI-compatible gateway in front of vLLM engines.

Invariants (docs/router.md):

* the body goes to the chosen engine **unchanged** and the engine's reply comes back byte for
  byte, as it arrives (server-sent events included), with ``x-kvatlas-engine: ID``;
* the router answers with an OpenAI error object (``{"error": {"message", "type", "param",
  "code"}}``) for everything it refuses itself — bad JSON, no or unknown model, an empty
  prompt, a prompt over the engine's context (400/404), auth (401/403), a body over the limit
  (413), no engine healthy (503) — and passes an engine's own errors through untouched;
* a request an engine refused before sending a byte is retried once, on the next engine of
  the same ranking; the refusing engine leaves the set until a health check passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import aiohttp
import anyio
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvatlas.api import InstanceRow
from kvatlas.auth import Principal, TokenAuth
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.client.route_client import AsyncRouteClient
from kvatlas.errors import InvalidInput, KvatlasError, NotFound, Unavailable
from kvatlas.router.config import RouterConfig
from kvatlas.router.engines import Engine, EngineSet
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.openai_body import Kind, RouteRequest, parse_request
from kvatlas.router.policies import (
    NO_COVERAGE,
    Candidate,
    Coverage,
    Policy,
    uncomputed_tokens,
)
from kvatlas.router.tokenizer import PromptTokenizer
from kvatlas.web import read_body

log = logging.getLogger(__name__)

ENGINE_HEADER: Final = "x-kvatlas-engine"
_ERROR_TYPES: Final = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 413: "RequestTooLargeError", 422: "BadRequestError",
    503: "ServiceUnavailableError",
}  # fmt: skip
_FORWARD_REQUEST_HEADERS: Final = ("content-type", "accept", "x-request-id")
_FORWARD_REPLY_HEADERS: Final = (
    "content-type", "content-length", "content-encoding", "cache-control", "x-request-id",
)  # fmt: skip
_REFUSALS: Final = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                    aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError)  # fmt: skip
"""Failures before the engine sent a byte: connect refused or timed out, the connection
closed or reset before any reply byte."""
_TOKENIZE_IN_THREAD_BYTES: Final = 16_384
_USAGE_TAIL_BYTES: Final = 16_384
_json = msgspec.json.Encoder()


def openai_error(status: int, message: str) -> Response:
    """An OpenAI error object, the shape vLLM answers with."""
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": None, "code": status}}  # fmt: skip
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return Response(_json.encode(body), status, headers, media_type="application/json")


def cached_tokens(reply: bytes, stream: bool) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a reply (of its last SSE event that
    has a usage, for a stream); ``None`` when the engine did not say."""
    candidates = [reply]
    if stream:
        events = [e for e in reply.split(b"\n") if e.startswith(b"data: {") and b'"usage"' in e]
        candidates = [e[len(b"data: ") :] for e in reversed(events)]
    for text in candidates:
        try:
            usage = msgspec.json.decode(text).get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            value = details.get("cached_tokens")
        except (msgspec.DecodeError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int | None) -> bool:
    """vLLM's check: prompt + max_tokens within the context, or a prompt that leaves room."""
    if max_model_len is None:
        return True
    if max_tokens is None:
        return prompt_tokens < max_model_len
    return prompt_tokens + max_tokens <= max_model_len


class Router:
    """Tokenize, score, choose, proxy; and the loops that keep engines' health and load."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.auth: TokenAuth | None = config.auth()
        self.metrics = RouterMetrics()
        self.policy = Policy(config.policy, config.cost_model(), config.seed)
        self.http: aiohttp.ClientSession | None = None  # made on the event loop: start()
        self.engines = EngineSet(config.engines)
        self.coordinator = (
            AsyncRouteClient(config.coordinator_url, token=config.coordinator_bearer())
            if config.coordinator_url
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Sessions (aiohttp: a quarter of httpx's CPU per call, docs/router.md), a first
        health check of every engine, then the health and metrics loops."""
        config = self.config
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s,
                                          sock_read=config.engine_timeout_s),
            auto_decompress=False,  # bytes pass through as the engine sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )  # fmt: skip
        self.engines.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=max(1.0, config.health_interval_s))
        )
        await self.refresh_engines()
        self._tasks = [
            asyncio.create_task(self._every(self.config.health_interval_s, self.refresh_engines)),
            asyncio.create_task(self._every(self.config.metrics_interval_s, self.scrape_engines)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.http is not None:
            await self.http.close()
        if self.engines.http is not None:
            await self.engines.http.close()
        if self.coordinator is not None:
            await self.coordinator.aclose()

    async def _every(self, interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await work()
            except Exception:  # a loop that dies would freeze health: log and go on
                log.exception("router background work failed")

    async def refresh_engines(self) -> None:
        if self.config.engines_from_coordinator and self.coordinator is not None:
            try:
                rows = await self.coordinator.instances()
                self.engines.merge_listed(self.listed_engines(rows))
            except CoordinatorError as exc:
                log.warning("cannot list engines at the coordinator: %s", exc)
        await asyncio.gather(*(self.engines.check(e) for e in self.engines.all()))

    async def scrape_engines(self) -> None:
        await asyncio.gather(*(self.engines.scrape(e) for e in self.engines.healthy()))

    def listed_engines(self, rows: Sequence[InstanceRow]) -> dict[str, str]:
        """Instances with a URL to reach them: ``metadata.openai_url``, else the template.
        A node that serves an engine (its row names an ``engine_id``) is not one: its copies
        are scored as its engine's, which is routed by its own id."""
        found: dict[str, str] = {}
        template = self.config.engine_url_template
        for row in rows:
            if isinstance(row.engine_id, str) and row.engine_id:
                continue
            engine_id = row.instance_id
            url = row.meta.get("openai_url")
            if not isinstance(url, str) and template:
                url = template.format(instance_id=engine_id)
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                found[engine_id] = url.rstrip("/")
        return found

    # ------------------------------------------------------------------ requests

    def _caller(self, request: Request) -> Principal | None:
        if self.auth is None:
            return None
        who = self.auth.authenticate(request.headers.get("authorization"))
        who.require("route")
        return who

    async def _parse(self, kind: Kind, raw: bytes) -> RouteRequest:
        if self.tokenizer is not None and len(raw) > _TOKENIZE_IN_THREAD_BYTES:
            return await anyio.to_thread.run_sync(parse_request, kind, raw, self.tokenizer)
        return parse_request(kind, raw, self.tokenizer)

    def _serving(self, req: RouteRequest) -> list[Engine]:
        healthy = self.engines.healthy()
        if not healthy:
            raise Unavailable("no engine is healthy")
        serving = [e for e in healthy if e.serves(req.model)]
        if not serving:
            if any(e.serves(req.model) for e in self.engines.all()):
                raise Unavailable(f"no engine serving model {req.model!r} is healthy")
            raise NotFound(f"The model `{req.model}` does not exist.")
        if req.prompt_tokens is None:
            return serving
        n = len(req.prompt_tokens)
        fitting = [e for e in serving if fits(n, req.max_tokens, e.max_model_len(req.model))]
        if not fitting:
            longest = max(e.max_model_len(req.model) or 0 for e in serving)
            asked = "" if req.max_tokens is None else f" + {req.max_tokens} max_tokens"
            raise InvalidInput(
                f"This model's maximum context length is {longest} tokens. However, your "
                f"request has {n} input tokens{asked}. Please reduce the length of the input."
            )
        return fitting

    async def _coverage(self, req: RouteRequest, engines: list[Engine]) -> dict[str, Coverage]:
        if not self.policy.uses_coverage or req.prompt_tokens is None or self.coordinator is None:
            return {}
        try:
            scores = await self.coordinator.score(
                req.prompt_tokens, self.config.model_name or req.model,
                cache_salt=req.cache_salt, instances=[e.engine_id for e in engines],
                timeout=self.config.score_timeout_s,
            )  # fmt: skip
        except CoordinatorError as exc:
            self.metrics.score_failures.inc()
            log.debug("route score failed: %s", exc)
            return {}
        return {
            s.instance_id: Coverage(s.prefix_tokens, s.fragment_tokens, s.by_tier)
            for s in scores.instances
        }

    async def handle(self, kind: Kind, request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            who = self._caller(request)
            raw = await read_body(request, self.config.max_body_bytes)
            req = await self._parse(kind, raw)
            if who is not None:
                who.require_salts([req.cache_salt], role="route")
            if req.untokenized_reason is not None:
                self.metrics.untokenized.labels(req.untokenized_reason).inc()
            engines = self._serving(req)
            coverage = await self._coverage(req, engines)
            n = len(req.prompt_tokens) if req.prompt_tokens is not None else 0
            candidates = [
                Candidate(e.engine_id, self.engines.load(e), coverage.get(e.engine_id, NO_COVERAGE))
                for e in engines
            ]
            ranked = self.policy.rank(candidates, n)
            self.metrics.decision_seconds.observe(time.perf_counter() - arrived)
            return await self._proxy(kind, request, raw, req, ranked[:2], arrived)
        except KvatlasError as exc:
            self.metrics.errors.labels(str(exc.status)).inc()
            return openai_error(exc.status, exc.detail)
        except Exception:  # a bug: logged with its traceback, the client gets an error object
            log.exception("router failed on a %s request", kind)
            self.metrics.errors.labels("500").inc()
            return openai_error(500, "internal router error (logged)")

    def _uncomputed(self, req: RouteRequest, cover: Coverage) -> int:
        if req.prompt_tokens is None:
            return int(self.engines.mean_prompt_tokens)
        return uncomputed_tokens(len(req.prompt_tokens), cover)

    async def _proxy(self, kind: Kind, request: Request, raw: bytes, req: RouteRequest,
                     ranked: list[Any], arrived: float) -> Response:  # fmt: skip
        headers = {k: v for k in _FORWARD_REQUEST_HEADERS if (v := request.headers.get(k))}
        headers.setdefault("content-type", "application/json")
        if self.auth is None and (token := request.headers.get("authorization")):
            headers["authorization"] = token  # the engine's own --api-key, when the router has none
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        for attempt, choice in enumerate(ranked):
            engine = self.engines.engines.get(choice.engine_id)
            if engine is None or not engine.healthy:
                continue
            uncomputed = self._uncomputed(req, choice.coverage)
            self.engines.sent(engine, uncomputed)
            assert self.http is not None, "Router.start() makes the session"
            try:
                reply = await self.http.post(engine.url + path, data=raw, headers=headers)
            except _REFUSALS as exc:
                self.engines.first_byte(engine, uncomputed)
                self.engines.finished(engine)
                self.engines.refused(engine)
                log.info("engine %s refused (%s)", engine.engine_id, type(exc).__name__)
                if attempt + 1 < len(ranked):
                    self.metrics.retries.inc()
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:  # after the request went out
                self.engines.first_byte(engine, uncomputed)
                self.engines.finished(engine)
                raise Unavailable(f"engine {engine.engine_id} did not answer: {exc!r}") from None
            self.metrics.decisions.labels(self.policy.name, engine.engine_id).inc()
            if req.prompt_tokens is not None:
                self.metrics.prompt_tokens.labels(engine.engine_id).inc(len(req.prompt_tokens))
                reused = choice.coverage.prefix_tokens + choice.coverage.fragment_tokens
                self.metrics.predicted_reused.labels(engine.engine_id).inc(
                    min(reused, len(req.prompt_tokens))
                )
            out_headers = {k: v for k in _FORWARD_REPLY_HEADERS if (v := reply.headers.get(k))}
            out_headers[ENGINE_HEADER] = engine.engine_id
            return StreamingResponse(
                self._relay(engine, reply, req, uncomputed, arrived),
                status_code=reply.status,
                headers=out_headers,
            )
        raise Unavailable("no engine accepted the request (each refused the connection)")

    async def _relay(self, engine: Engine, reply: aiohttp.ClientResponse, req: RouteRequest,
                     uncomputed: int, arrived: float) -> AsyncIterator[bytes]:  # fmt: skip
        first, complete = True, False
        kept = bytearray()
        try:
            async for chunk in reply.content.iter_any():
                if first:
                    first = False
                    self.engines.first_byte(engine, uncomputed)
                    self.metrics.ttft_seconds.observe(time.perf_counter() - arrived)
                kept += chunk
                if req.stream and len(kept) > 2 * _USAGE_TAIL_BYTES:
                    del kept[:-_USAGE_TAIL_BYTES]
                yield chunk
            complete = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.aborted_streams.inc()
            log.info("engine %s: reply cut: %r", engine.engine_id, exc)
        finally:
            if first:
                self.engines.first_byte(engine, uncomputed)
            self.engines.finished(engine)
            self.metrics.e2e_seconds.observe(time.perf_counter() - arrived)
            if complete:
                reply.release()  # the connection goes back to the pool
            else:
                reply.close()  # a reply not read to its end (engine failed, client left)
            if complete and reply.status == 200 and reply.headers.get("content-encoding") is None:
                found = cached_tokens(bytes(kept), req.stream)
                if found is not None:
                    self.metrics.reported_reused.labels(engine.engine_id).inc(found)

    # ------------------------------------------------------------------ other routes

    async def models(self, request: Request) -> Response:
        try:
            self._caller(request)
        except KvatlasError as exc:
            return openai_error(exc.status, exc.detail)
        seen: dict[str, int | None] = {}
        for engine in self.engines.healthy():
            for model, length in (engine.models or {}).items():
                seen[model] = max(length or 0, seen.get(model) or 0) or None
        data = [{"id": m, "object": "model", "owned_by": "kvatlas-router", "max_model_len": n}
                for m, n in sorted(seen.items())]  # fmt: skip
        return Response(
            _json.encode({"object": "list", "data": data}), media_type="application/json"
        )

    async def healthz(self, _: Request) -> Response:
        healthy = self.engines.healthy()
        body = {
            "status": "healthy" if healthy else "no engine healthy",
            "policy": self.policy.name,
            "engines": {
                e.engine_id: {"url": e.url, "healthy": e.healthy, "in_flight": e.in_flight}
                for e in self.engines.all()
            },
        }
        return Response(_json.encode(body), 200 if healthy else 503, media_type="application/json")

    async def prometheus(self, request: Request) -> Response:
        if self.auth is not None:
            try:
                self.auth.authenticate(request.headers.get("authorization")).require("admin")
            except KvatlasError as exc:
                return openai_error(exc.status, exc.detail)
        self.metrics.engines_out.set(self.engines.out_of_set())
        self.metrics.engines_known.set(len(self.engines.engines))
        self.metrics.in_flight.clear()  # an engine that left the set leaves no series behind
        for engine in self.engines.all():
            self.metrics.in_flight.labels(engine.engine_id).set(engine.in_flight)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(router: Router) -> Starlette:
    async def completions(request: Request) -> Response:
        return await router.handle("completions", request)

    async def chat(request: Request) -> Response:
        return await router.handle("chat", request)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/healthz", router.healthz, methods=["GET"]),
            Route("/metrics", router.prometheus, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
