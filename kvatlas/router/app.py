"""The router's HTTP surface: an OpenAI-compatible gateway in front of vLLM engines.

Invariants (docs/router.md):

* the body goes to the chosen engine **unchanged** and the engine's reply comes back byte for
  byte, as it arrives (server-sent events included), with ``x-kvatlas-engine: ID``;
* the router answers with an OpenAI error object (``{"error": {"message", "type", "param",
  "code"}}``) for everything it refuses itself — bad JSON, no or unknown model, an empty
  prompt, a prompt over the engine's context (400/404), auth (401/403), a body over the limit
  (413), no engine healthy (503) — and passes an engine's own errors through untouched;
* a request an engine refused before sending a byte is retried once, on the next engine of
  the same ranking; the refusing engine leaves the set until a health check passes;
* a client that leaves before its reply's end closes the engine's connection (it aborts); an
  engine's reply cut mid-way (closed, stalled past ``--engine-timeout-s``) cuts the client's:
  its connection closes without the body's end, never a reply that looks whole, never a hang.

Engines are called through :class:`~kvatlas.client.keepalive.KeepAliveClient` (one pool of
keep-alive connections per engine URL, replies streamed as they arrive).

The two completion routes are answered by plain ASGI in front of Starlette (no request object,
middleware or task group per request: docs/router.md, "The router's own cost"); the other
routes are Starlette's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

import aiohttp
import anyio
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvatlas.auth import Principal, TokenAuth, authorization_of
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.client.keepalive import KeepAliveClient, Refused, StreamedReply
from kvatlas.client.route_client import AsyncRouteClient
from kvatlas.errors import KvatlasError, NotFound, Unavailable
from kvatlas.router.config import RouterConfig
from kvatlas.router.engines import Engine, EngineSet, listed_engines
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.openai_body import Kind, RouteRequest, parse_request
from kvatlas.router.policies import (
    NO_COVERAGE,
    Candidate,
    Coverage,
    Policy,
    uncomputed_tokens,
)
from kvatlas.router.replies import (
    ClientWatch,
    Relay,
    ReplyCut,
    mark_cut,
    openai_error,
    send_openai_error,
)
from kvatlas.router.scores import HttpScorer, Scorer, ScorerOf
from kvatlas.router.tokenizer import PromptTokenizer
from kvatlas.vllm_limits import over_context, too_few_output_tokens
from kvatlas.web import check_declared_length, nested_too_deep, receive_body

log = logging.getLogger(__name__)

ENGINE_HEADER: Final = "x-kvatlas-engine"
_ENGINE_HEADER_BYTES: Final = ENGINE_HEADER.encode()
_FORWARD_REQUEST_HEADERS: Final = (b"content-type", b"accept", b"x-request-id")
_FORWARD_REPLY_HEADERS: Final = frozenset(
    (b"content-type", b"content-length", b"content-encoding", b"cache-control", b"x-request-id")
)
_MAX_IDLE: Final = 256  # idle keep-alive connections kept per engine
_TOKENIZE_IN_THREAD_BYTES: Final = 16_384
_json = msgspec.json.Encoder()


def _header_map(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (the first of repeated ones)."""
    found: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        found.setdefault(name, value)
    return found


class Router:
    """Tokenize, score, choose, proxy; and the loops that keep engines' health and load."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PromptTokenizer | None = None,
        scorer_of: ScorerOf | None = None,
    ) -> None:
        """``scorer_of``: where scores come from, given the router's HTTP scorer (default:
        that one, the coordinator over HTTP when ``--coordinator-url`` is given;
        ``--scores-from replica`` hands in its own, which falls back on it)."""
        self.config = config
        self.tokenizer = tokenizer
        self.auth: TokenAuth | None = config.auth()
        token = config.coordinator_bearer()  # read whatever the policy: a bad file stops it
        self.metrics = RouterMetrics(lambda: () if self.scorer is None else self.scorer.series())
        self.policy = Policy(config.policy, config.cost_model(), config.seed)
        self._pools: dict[str, KeepAliveClient] = {}
        """Engine URL → its connections (keep-alive, streamed replies)."""
        self.engines = EngineSet(config.engines)
        self.coordinator = (
            AsyncRouteClient(
                config.coordinator_url,
                token=token,
                on_json_fallback=self.metrics.score_json_fallbacks.inc,
            )
            if config.coordinator_url
            else None
        )
        http = None if self.coordinator is None else HttpScorer(self.coordinator)
        self.scorer: Scorer | None = http if scorer_of is None else scorer_of(http)
        self._tasks: list[asyncio.Task[None]] = []
        self._created = int(time.time())  # (/v1/models: an OpenAI model's creation time)
        self._scoring = True  # the last score call had its scores (logged when it changes)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """The probes' session, a first health check of every engine, then the health and
        metrics loops. Engine calls go through one :class:`KeepAliveClient` per engine URL,
        made on first use (``_pool``)."""
        self.engines.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=max(1.0, self.config.health_interval_s))
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
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self.engines.http is not None:
            await self.engines.http.close()
        if self.scorer is not None:
            await self.scorer.aclose()
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
                self.engines.merge_listed(listed_engines(rows, self.config.engine_url_template))
            except CoordinatorError as exc:
                log.warning("cannot list engines at the coordinator: %s", exc)
        await asyncio.gather(*(self.engines.check(e) for e in self.engines.all()))
        self.metrics.retain(e.engine_id for e in self.engines.all())
        urls = {e.url for e in self.engines.all()}
        for url in [u for u in self._pools if u not in urls]:  # an engine that left
            self._pools.pop(url).close()

    async def scrape_engines(self) -> None:
        await asyncio.gather(*(self.engines.scrape(e) for e in self.engines.healthy()))

    # ------------------------------------------------------------------ requests

    def _caller(self, headers: Iterable[tuple[bytes, bytes]]) -> Principal | None:
        if self.auth is None:
            return None
        who = self.auth.authenticate(authorization_of(headers))
        who.require("route")
        return who

    async def _parse(self, kind: Kind, raw: bytes) -> RouteRequest:
        """The body read (a body nested deeper than the decoder follows: a 422, counted as
        the coordinator's and the node's are, never a 500)."""
        try:
            if self.tokenizer is not None and len(raw) > _TOKENIZE_IN_THREAD_BYTES:
                return await anyio.to_thread.run_sync(parse_request, kind, raw, self.tokenizer)
            return parse_request(kind, raw, self.tokenizer)
        except RecursionError:
            raise nested_too_deep(self.metrics.http_refused.count) from None

    def _serving(self, req: RouteRequest) -> list[Engine]:
        healthy = self.engines.healthy()
        if not healthy:
            raise Unavailable("no engine is healthy")
        serving = [e for e in healthy if e.serves(req.model)]
        if not serving:
            if any(e.serves(req.model) for e in self.engines.all()):
                raise Unavailable(f"no engine serving model {req.model!r} is healthy")
            served = sorted({m for e in self.engines.all() for m in e.models or ()})
            raise NotFound(f"The model `{req.model}` does not exist. Valid aliases: "  # vLLM's
                           f"{', '.join(served)}.", param="model")  # fmt: skip
        if req.prompt_tokens is None:
            return serving
        n = len(req.prompt_tokens)
        fitting = [e for e in serving if e.fits(req.model, n, req.max_tokens)]
        if not fitting:  # what the longest context's engine would answer, in vLLM's words
            longest = max(e.max_model_len(req.model) or 0 for e in serving)
            refused = over_context(longest, n, req.max_tokens, req.max_tokens_field)
            raise refused or too_few_output_tokens(longest - n)  # (the prompt fills it)
        return fitting

    async def _coverage(
        self, req: RouteRequest, engines: list[Engine], who: Principal | None
    ) -> dict[str, Coverage]:
        if not self.policy.uses_coverage or req.prompt_tokens is None or self.scorer is None:
            return {}
        try:
            scores = await self.scorer.score(
                req.prompt_tokens, self.config.model_name or req.model, req.cache_salt,
                [e.engine_id for e in engines], self.config.score_timeout_s, who,
            )  # fmt: skip
        except CoordinatorError as exc:
            self.metrics.score_failures.inc()
            if self._scoring:  # (once, not a line a request: the counter counts each)
                log.warning("no route scores (%s): routing by load until they are back", exc)
            self._scoring = False
            return {}
        if not self._scoring:
            log.info("route scores are back")
            self._scoring = True
        return {
            s.instance_id: Coverage(s.prefix_tokens, s.fragment_tokens, s.by_tier)
            for s in scores.instances
        }

    async def handle(self, kind: Kind, scope: Scope, receive: Receive, send: Send) -> None:
        """One completion request, from ASGI in to the engine's reply out (or an error)."""
        arrived = time.perf_counter()
        headers = _header_map(scope)
        watch, sent = ClientWatch(receive), False
        try:
            who = self._caller(scope["headers"])
            check_declared_length(headers.get(b"content-length"), self.config.max_body_bytes)
            raw = await receive_body(receive, self.config.max_body_bytes)
            if raw is None:  # the client left before its body was in
                return
            watch.start()
            req = await self._parse(kind, raw)
            if who is not None:
                who.require_salts([req.cache_salt], role="route")
            if req.untokenized_reason is not None:
                self.metrics.untokenized.labels(req.untokenized_reason).inc()
            engines = self._serving(req)
            coverage = await self._coverage(req, engines, who)
            n = len(req.prompt_tokens) if req.prompt_tokens is not None else 0
            load = self.engines.load
            candidates = [
                Candidate(e.engine_id, load(e), coverage.get(e.engine_id, NO_COVERAGE))
                for e in engines
            ]
            ranked = self.policy.rank(candidates, n)
            self.metrics.decision_seconds.observe(time.perf_counter() - arrived)
            sent = True
            engine, reply, uncomputed = await self._proxy(kind, headers, raw, req, ranked[:2])
        except asyncio.CancelledError:
            watch.stop()
            if not watch.caused():
                raise  # cancelled by someone else (shutdown): not ours to swallow
            if sent:  # the engine had the request: its connection is closed (_proxy)
                self.metrics.aborted_streams.inc()
            return
        except Exception as exc:  # refused; or a bug: logged, the client gets an error object
            watch.stop()
            if not isinstance(exc, KvatlasError):
                log.exception("router failed on a %s request", kind)
                exc = KvatlasError("internal router error (logged)")  # (500)
            self.metrics.errors.labels(str(exc.status)).inc()
            await send_openai_error(send, exc.status, exc.detail, exc.extra.get("param"),
                                    exc.extra.get("type"))  # fmt: skip
            return
        out = [(k, v) for k, v in reply.headers if k in _FORWARD_REPLY_HEADERS]
        out.append((_ENGINE_HEADER_BYTES, engine.engine_id.encode()))
        await self._stream(send, watch, reply.status, out,
                           Relay(self.engines, self.metrics, self.policy.name, engine, reply, req, uncomputed, arrived))  # fmt: skip

    @staticmethod
    async def _stream(send: Send, watch: ClientWatch, status: int,
                      headers: list[tuple[bytes, bytes]], chunks: Relay) -> None:  # fmt: skip
        """Send ``chunks`` as they come. A client that leaves cancels this (``watch``), which
        closes the engine's reply in ``chunks``' cleanup. A reply whose body came whole with
        its head (a non-streamed completion) has nothing left to wait for: it goes out as one
        message."""
        if chunks.reply.complete:
            watch.stop()
            try:
                body = b"".join([chunk async for chunk in chunks])
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
            finally:
                chunks.close()
            return
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.stop()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ReplyCut:
            mark_cut()  # no end of body: the server closes the client's connection
        except asyncio.CancelledError:
            if not watch.caused():
                raise  # cancelled by someone else (shutdown): not ours to swallow
        finally:
            watch.stop()
            chunks.close()  # also when it was never read (cancelled before the first piece)

    def _uncomputed(self, req: RouteRequest, cover: Coverage) -> int:
        if req.prompt_tokens is None:
            return int(self.engines.mean_prompt_tokens)
        return uncomputed_tokens(len(req.prompt_tokens), cover)

    def _pool(self, engine: Engine) -> KeepAliveClient:
        pool = self._pools.get(engine.url)
        if pool is None:
            pool = self._pools[engine.url] = KeepAliveClient(engine.url, max_idle=_MAX_IDLE)
        return pool

    def _forwarded_headers(self, request_headers: dict[bytes, bytes]) -> str:
        """The request's header lines the engine gets (``content-type`` by default JSON; the
        client's ``authorization`` only when the router has no auth of its own)."""
        lines = [f"{k.decode()}: {v.decode('latin-1')}\r\n" for k in _FORWARD_REQUEST_HEADERS
                 if (v := request_headers.get(k))]  # fmt: skip
        if b"content-type" not in request_headers:
            lines.append("content-type: application/json\r\n")
        if self.auth is None and (token := request_headers.get(b"authorization")):
            lines.append(f"authorization: {token.decode('latin-1')}\r\n")  # the engine's --api-key
        return "".join(lines)

    async def _proxy(self, kind: Kind, request_headers: dict[bytes, bytes], raw: bytes,
                     req: RouteRequest, ranked: list[Any]
                     ) -> tuple[Engine, StreamedReply, int]:  # fmt: skip
        """Send the body to the best engine that accepts it (the next on a refusal): the
        engine, its reply (head read, body not) and the request's uncomputed tokens."""
        headers = self._forwarded_headers(request_headers)
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        config = self.config
        for attempt, choice in enumerate(ranked):
            engine = self.engines.engines.get(choice.engine_id)
            if engine is None or not engine.healthy:
                continue
            uncomputed = self._uncomputed(req, choice.coverage)
            self.engines.sent(engine, uncomputed)
            try:
                reply = await self._pool(engine).stream(
                    "POST", path, raw, headers, connect_timeout_s=config.connect_timeout_s,
                    read_timeout_s=config.engine_timeout_s,
                )  # fmt: skip
            except Refused as exc:  # no byte came: another engine may take it
                self.engines.first_byte(engine, uncomputed)
                self.engines.finished(engine)
                self.engines.refused(engine)
                log.info("engine %s refused (%s)", engine.engine_id, exc)
                if attempt + 1 < len(ranked):
                    self.metrics.retries.inc()
                continue
            except (OSError, TimeoutError) as exc:  # after the request went out
                self.engines.first_byte(engine, uncomputed)
                self.engines.finished(engine)
                raise Unavailable(f"engine {engine.engine_id} did not answer: {exc!r}") from None
            except BaseException:  # cancelled (shutdown, client gone): the count stays right
                self.engines.first_byte(engine, uncomputed)
                self.engines.finished(engine)
                raise
            series = self.metrics.engine(engine.engine_id, self.policy.name)
            series.decisions.inc()
            if req.prompt_tokens is not None:
                series.prompt_tokens.inc(len(req.prompt_tokens))
                reused = choice.coverage.prefix_tokens + choice.coverage.fragment_tokens
                series.predicted_reused.inc(min(reused, len(req.prompt_tokens)))
            return engine, reply, uncomputed
        raise Unavailable("no engine accepted the request (each refused the connection)")

    # ------------------------------------------------------------------ other routes

    async def models(self, request: Request) -> Response:
        try:
            self._caller(request.headers.raw)
        except KvatlasError as exc:
            return openai_error(exc.status, exc.detail)
        seen: dict[str, int | None] = {}
        for engine in self.engines.healthy():
            for model, length in (engine.models or {}).items():
                seen[model] = max(length or 0, seen.get(model) or 0) or None
        data = [{"id": m, "object": "model", "created": self._created, "owned_by": "kvatlas-router",
                 "max_model_len": n} for m, n in sorted(seen.items())]  # fmt: skip
        return Response(
            _json.encode({"object": "list", "data": data}), media_type="application/json"
        )

    async def healthz(self, _: Request) -> Response:
        healthy = self.engines.healthy()
        body = {
            "status": "healthy" if healthy else "no engine healthy",
            "policy": self.policy.name,
            "scores": "none" if self.scorer is None else self.scorer.status(),
            "engines": {
                e.engine_id: {"url": e.url, "healthy": e.healthy, "in_flight": e.in_flight}
                for e in self.engines.all()
            },
        }
        return Response(_json.encode(body), 200 if healthy else 503, media_type="application/json")

    async def prometheus(self, request: Request) -> Response:
        if self.auth is not None:
            try:
                self.auth.authenticate(authorization_of(request.headers.raw)).require("admin")
            except KvatlasError as exc:
                return openai_error(exc.status, exc.detail)
        out, known = self.engines.out_of_set(), len(self.engines.engines)
        in_flight = [(e.engine_id, e.in_flight) for e in self.engines.all()]  # on the loop
        # off the loop: a replica's series read its directory, whose lock a change may hold
        body = await anyio.to_thread.run_sync(self.metrics.render, out, known, in_flight)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
