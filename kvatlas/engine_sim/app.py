"""The engine's HTTP surface: vLLM's OpenAI routes over :class:`EngineDriver`.

Routes hold no engine logic: they parse (:mod:`.openai_wire`), tokenize, submit and write what
the driver delivers. ``/health``, ``/v1/models``, ``/metrics`` and ``POST
/reset_prefix_cache`` are vLLM's; ``/healthz`` is the simulation's own (its counters as JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from kvatlas.engine_sim import openai_wire as wire
from kvatlas.engine_sim.config import EngineSimConfig
from kvatlas.engine_sim.engine import EngineDriver, Stream
from kvatlas.engine_sim.scheduler import FINISH_LENGTH, FINISH_STOP, SimRequest
from kvatlas.engine_sim.tokenizer import Tokenizer
from kvatlas.errors import InvalidInput, KvatlasError
from kvatlas.vllm_limits import empty_prompt, over_context, too_few_output_tokens
from kvatlas.vllm_request_models import StreamOptions, given_request_id
from kvatlas.web import client_gone, read_body

JSON = "application/json"


class EngineApi:
    def __init__(self, config: EngineSimConfig, driver: EngineDriver, tokenizer: Tokenizer) -> None:
        self.config = config
        self.driver = driver
        self.tokenizer = tokenizer
        self.created = int(time.time())

    # ------------------------------------------------------------------ routes

    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._guarded(request, chat=True)

    async def models(self, _: Request) -> Response:
        body = wire.models_reply(self.config.model, self.created, self.config.max_model_len)
        return Response(body, media_type=JSON)

    async def health(self, _: Request) -> Response:
        return Response(status_code=200)

    async def healthz(self, _: Request) -> Response:
        core, pool = self.driver.core, self.driver.pool
        return JSONResponse({
            "status": "ok", "model": self.config.model, "instance_id": self.config.instance_id,
            "topic": self.config.topic, "tokenizer": self.tokenizer.name,
            "model_time_s": self.driver.now_s(), "running": len(core.running),
            "waiting": len(core.waiting), "free_blocks": pool.free_blocks,
            "cached_blocks": len(pool.cached), "cpu_blocks": len(pool.cpu),
            "scheduler": asdict(core.counts), "cache": asdict(pool.counts),
            "kv_event_batches": self.driver.publisher.sent if self.driver.publisher else 0,
            "connector": dict(self.driver.connector.counts) if self.driver.connector else None,
        })  # fmt: skip

    async def metrics(self, _: Request) -> Response:
        body = self.driver.metrics.render(self.driver.core)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, _: Request) -> Response:
        if not self.driver.reset_prefix_cache():
            return self._error("blocks are in use by running requests", 400)
        return Response(status_code=200)

    # ------------------------------------------------------------------ generation

    async def _guarded(self, request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request, self.config.max_body_bytes)
            req = wire.read_request("chat" if chat else "completions", body,
                                    request.headers.get("content-type"), self.config.model)  # fmt: skip
            caller_id = request.headers.get("x-request-id")
            work = self._generate(req, chat, caller_id)
            return await _unless_client_leaves(request.receive, work)
        except KvatlasError as exc:
            if exc.extra.get("detail_only"):  # FastAPI's own answer (kvatlas.vllm_requests)
                return JSONResponse({"detail": exc.detail}, exc.status)
            return self._error(exc.detail or str(exc), exc.status, exc.extra.get("param"),
                               exc.extra.get("type"))  # fmt: skip

    @staticmethod
    def _error(message: str, status: int, param: str | None = None,
               kind: str | None = None) -> Response:  # fmt: skip
        body = wire.error_body(message, status, param, kind)
        return Response(body, status_code=status, media_type=JSON)

    async def _generate(self, req: Any, chat: bool, caller_id: str | None) -> Response:
        cfg = self.config
        if chat:
            prompt = self.tokenizer.chat_prompt(wire.chat_messages(req), **wire.chat_options(req))
            max_tokens, limit_name = req.max_tokens, "max_tokens"
            if req.max_completion_tokens is not None:  # vLLM's: max_completion_tokens unless null
                max_tokens, limit_name = req.max_completion_tokens, "max_completion_tokens"
        else:
            text_or_ids = wire.prompt_of(req)
            prompt = (self.tokenizer.encode(text_or_ids, req.add_special_tokens)
                      if isinstance(text_or_ids, str) else list(text_or_ids))  # fmt: skip
            max_tokens, limit_name = wire.completion_limit(req), "max_tokens"
        max_tokens, finish = _output_limit(cfg, len(prompt), max_tokens, limit_name)
        if not prompt:  # after the output limit's checks, as vLLM's input processor
            raise empty_prompt()
        total = len(prompt) + max_tokens
        if -(-total // cfg.block_size) > self.driver.pool.usable_blocks:
            raise InvalidInput(f"{total} tokens need more KV blocks than the engine has "
                               f"({self.driver.pool.usable_blocks} of {cfg.block_size} tokens)")  # fmt: skip
        rid = wire.request_id(chat)
        reply_id = wire.reply_id(chat, caller_id, given_request_id(req), rid)
        sim = SimRequest(rid, prompt, max_tokens, 0.0, req.cache_salt, finish)
        if self.driver.connector is not None:
            await self._ask_node(sim)
        sim.arrival_s = self.driver.now_s()  # after the node's answer (docs/engine-sim.md)
        stream = self.driver.submit(sim)
        if req.stream:
            options = req.stream_options or StreamOptions()
            return StreamingResponse(
                self._sse(stream, chat, options, reply_id), media_type="text/event-stream"
            )
        try:
            text = await self._collect(stream)
        except asyncio.CancelledError:
            self.driver.abort(sim)
            raise
        usage = wire.usage_full(len(prompt), len(sim.output_ids), sim.num_cached_tokens or 0)
        reply = wire.chat_reply if chat else wire.completion_reply
        body = reply(reply_id, self.created_at(sim), cfg.model, text,
                     sim.finish_reason or finish, usage)  # fmt: skip
        return Response(body, media_type=JSON)

    async def _ask_node(self, sim: SimRequest) -> None:
        connector = self.driver.connector
        assert connector is not None
        local = self.driver.core.local_prefix(sim)
        reuse = await asyncio.to_thread(connector.fetch, sim.prompt, sim.cache_salt,
                                        sim.request_id, local)  # fmt: skip
        reuse.apply_to(sim, self.config.recompute_share)

    def created_at(self, sim: SimRequest) -> int:
        return self.created + int(sim.arrival_s / self.driver.speed)

    async def _collect(self, stream: Stream) -> str:
        ids = []
        while (out := await stream.tokens.get()) is not None:
            ids.append(out.token_id)
        return self.tokenizer.decode(ids)

    async def _sse(self, stream: Stream, chat: bool, options: StreamOptions,
                   rid: str) -> AsyncIterator[bytes]:  # fmt: skip
        sim, model = stream.request, self.config.model
        created = self.created_at(sim)
        chunk = wire.chat_chunk if chat else wire.completion_chunk
        n = 0
        continuous = bool(options.include_usage and options.continuous_usage_stats)
        try:
            while (out := await stream.tokens.get()) is not None:
                if chat and n == 0:
                    usage = wire.continuous_usage(len(sim.prompt), 0, chat) if continuous else None
                    yield wire.chat_role_chunk(rid, created, model, usage)
                n += 1
                usage = wire.continuous_usage(len(sim.prompt), n, chat) if continuous else None
                finish = sim.finish_reason if out.finished else None
                yield chunk(rid, created, model, self.tokenizer.decode([out.token_id]), finish,
                            usage)  # fmt: skip
            if options.include_usage:
                usage_all = wire.usage_closing(len(sim.prompt), n, sim.num_cached_tokens or 0)
                yield wire.usage_chunk(rid, created, model, chat, usage_all)
            yield wire.SSE_DONE
        finally:
            self.driver.abort(sim)  # a no-op once finished


def _output_limit(cfg: EngineSimConfig, prompt_tokens: int, asked: int | None,
                  name: str) -> tuple[int, str]:  # fmt: skip
    """The request's output limit and the finish reason it ends with, as vLLM 0.33 sets them
    (:mod:`kvatlas.vllm_limits`: what it refuses, and the limit cut to the context the prompt
    leaves, ``get_max_tokens``)."""
    context = cfg.max_model_len
    refused = over_context(context, prompt_tokens, asked, name)
    if refused is not None:
        raise refused
    left = context - prompt_tokens
    if asked is None:  # the model would stop on its own, unless the context ends first
        natural = cfg.natural_output_tokens
        limit, finish = (natural, FINISH_STOP) if natural <= left else (left, FINISH_LENGTH)
    else:
        limit, finish = min(asked, left), FINISH_LENGTH
    if limit < 1:
        raise too_few_output_tokens(limit)
    return limit, finish


async def _unless_client_leaves(receive: Receive, work: Coroutine[Any, Any, Response]) -> Response:
    """``work``, cancelled when its client leaves first (vLLM's ``with_cancellation``): a
    non-streamed request is aborted, its blocks freed. The body is in, so what ``receive``
    says next is ``http.disconnect``; a stream's reply watches the client itself."""
    task, left = asyncio.ensure_future(work), asyncio.ensure_future(client_gone(receive))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its abort has run
    return task.result() if not task.cancelled() else Response()  # nobody reads it


async def _as_fastapi_answers(_: Request, exc: Exception) -> Response:
    """An unknown path (404) or a wrong method (405, ``Allow``) as vLLM's FastAPI answers it:
    ``{"detail": ...}`` in JSON (Starlette's own answer is plain text)."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)


def create_app(config: EngineSimConfig, driver: EngineDriver, tokenizer: Tokenizer) -> Starlette:
    api = EngineApi(config, driver, tokenizer)

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        driver.start()
        try:
            yield
        finally:
            await driver.stop()

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/reset_prefix_cache", api.reset_prefix_cache, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: _as_fastapi_answers})  # fmt: skip
