"""The OpenAI API as vLLM 0.33 serves it: request bodies in, replies and SSE chunks out.

Replies carry vLLM's fields in vLLM's order: a whole reply is its pydantic model dumped in full
(``null`` fields included, as its ``JSONResponse`` writes it); a stream chunk only the fields
vLLM sets (``exclude_unset``); the closing usage chunk drops ``null`` fields; every SSE event is
``data: <json>\n\n`` and the stream ends with ``data: [DONE]\n\n``. ``usage`` always carries
``prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``).
Errors are vLLM's ``{"error": {"message", "type", "param", "code"}}``; a request is read and
refused as vLLM reads it (:mod:`kvatlas.vllm_requests`).
``tests/engine_sim/test_openai_api.py`` re-reads every shape with vLLM's own models.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kvatlas import vllm_requests
from kvatlas.errors import InvalidInput, NotFound
from kvatlas.vllm_requests import Kind

if TYPE_CHECKING:
    from kvatlas.vllm_request_models import ChatRequest, CompletionRequest

_ENCODER = msgspec.json.Encoder()


def completion_limit(request: CompletionRequest) -> int:
    """A completion's output limit: ``max_tokens``, its default (16) when ``null``."""
    return 16 if request.max_tokens is None else request.max_tokens


def read_request(kind: Kind, body: bytes, content_type: str | None, served: str) -> Any:
    """The body as vLLM's request model reads it, or vLLM's refusal
    (:mod:`kvatlas.vllm_requests`); then its model checked, as vLLM does first; then what the
    simulation itself cannot serve."""
    request = vllm_requests.read_request(kind, body, content_type)
    check_model(request.model, served)
    if request.n not in (1, None):
        raise InvalidInput("n must be 1 (the simulated engine samples one sequence)")
    return request


def prompt_of(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (vLLM's model has checked its type): text, or
    token ids below 2**32 (none at all is refused once the output limit is checked, as vLLM
    does: :func:`kvatlas.vllm_limits.empty_prompt`)."""
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidInput("one prompt per request (the simulated engine takes no batches)")
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and max(prompt) >= 1 << 32:
        raise InvalidInput("prompt must be text or a list of token ids in [0, 2**32)")
    return cast("str | list[int]", prompt)


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: ``role`` and text ``content`` (text parts
    joined with newlines, vLLM's "string" content format)."""
    out = []  # (none at all: the template renders them, as vLLM's does)
    for m in request.messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInput("every message must be an object with a 'role'")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": m["role"], "content": content or ""})
            continue
        if not isinstance(content, list):
            raise InvalidInput("a message's content must be text or a list of parts")
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidInput(f"content part type {kind!r} is not supported by "
                                   "this text-only model")  # fmt: skip
            texts.append(part["text"])
        out.append({"role": m["role"], "content": "\n".join(texts)})
    return out


def chat_options(request: ChatRequest) -> dict[str, Any]:
    """How the chat becomes a prompt, as vLLM reads the request (its defaults: the
    generation prompt added, no special tokens beyond the template's)."""
    return {"add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
            "add_special_tokens": request.add_special_tokens,
            "template_kwargs": request.chat_template_kwargs}  # fmt: skip


def check_model(requested: str | None, served: str) -> None:
    """vLLM 0.33's ``_check_model``, its first check of a request its models accept: no or an
    empty ``model`` is the served one."""
    if requested and requested != served:
        raise NotFound(f"The model `{requested}` does not exist. Valid aliases: {served}.",
                       param="model")  # fmt: skip


def error_body(message: str, status: int, param: str | None = None,
               kind: str | None = None) -> bytes:  # fmt: skip
    """vLLM's error object; ``kind`` (its ``type``) by the status unless given."""
    if kind is None:
        kind = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
                503: "ServiceUnavailableError"}.get(status, "InternalServerError")  # fmt: skip
    return _ENCODER.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def request_id(chat: bool) -> str:
    """A unique id for the simulation's own bookkeeping (its streams, the node's calls)."""
    return ("chatcmpl-" if chat else "cmpl-") + f"{uuid.uuid4().int & (2**64 - 1):016x}"


def reply_id(chat: bool, header: str | None, body_id: str | None, own: str) -> str:
    """The ``id`` a reply carries, as vLLM 0.33 makes it (``_base_request_id``): the
    ``X-Request-Id`` header, else the body's ``request_id``, else a random id (``own``)."""
    base = header if header is not None else body_id
    return own if base is None else ("chatcmpl-" if chat else "cmpl-") + base


def _details(cached: int) -> dict[str, Any]:
    return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}


def usage_full(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": _details(cached),
            "completion_tokens_details": None}  # fmt: skip


def usage_closing(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def completion_reply(rid: str, created: int, model: str, text: str, finish: str,
                     usage: dict[str, Any]) -> bytes:  # fmt: skip
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
              "prompt_token_ids": None, "routed_experts": None, "weight_versions": None}  # fmt: skip
    return _ENCODER.encode({"id": rid, "object": "text_completion", "created": created,
                            "model": model, "choices": [choice], "service_tier": None,
                            "system_fingerprint": None, "usage": usage,
                            "kv_transfer_params": None, "ec_transfer_params": None,
                            "metrics": None})  # fmt: skip


def chat_reply(rid: str, created: int, model: str, text: str, finish: str,
               usage: dict[str, Any]) -> bytes:  # fmt: skip
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "token_ids": None, "routed_experts": None,
              "weight_versions": None}  # fmt: skip
    return _ENCODER.encode({"id": rid, "object": "chat.completion", "created": created,
                            "model": model, "choices": [choice], "service_tier": None,
                            "system_fingerprint": None, "usage": usage,
                            "prompt_logprobs": None, "prompt_token_ids": None,
                            "prompt_text": None, "kv_transfer_params": None,
                            "ec_transfer_params": None, "metrics": None})  # fmt: skip


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None,
                     usage: dict[str, Any] | None = None) -> bytes:  # fmt: skip
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "prompt_token_ids": None, "token_ids": None,
              "weight_versions": None}  # fmt: skip
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                             "model": model, "choices": [choice]}  # fmt: skip
    if usage is not None:
        chunk["usage"] = usage
    chunk["kv_transfer_params"] = None
    return sse(chunk)


def chat_role_chunk(rid: str, created: int, model: str,
                    usage: dict[str, Any] | None = None) -> bytes:  # fmt: skip
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}  # fmt: skip
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": [choice]}  # fmt: skip
    if usage is not None:
        chunk["usage"] = usage
    chunk["prompt_token_ids"] = chunk["prompt_text"] = None
    return sse(chunk)


def chat_chunk(rid: str, created: int, model: str, text: str, finish: str | None,
               usage: dict[str, Any] | None = None) -> bytes:  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": finish}  # fmt: skip
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    if finish is not None:
        choice["weight_versions"] = None
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": [choice]}  # fmt: skip
    if usage is not None:
        chunk["usage"] = usage
    chunk["kv_transfer_params"] = None
    return sse(chunk)


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage: dict[str, Any]) -> bytes:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                "usage": usage})  # fmt: skip


def continuous_usage(prompt: int, completion: int, chat: bool) -> dict[str, Any]:
    """A chunk's usage with ``stream_options.continuous_usage_stats`` (a chat's, the role
    chunk's too, sets ``completion_tokens_details``; a completion's does not)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                             "completion_tokens": completion}  # fmt: skip
    if chat:
        usage["completion_tokens_details"] = None
    return usage


def models_reply(model: str, created: int, max_model_len: int) -> bytes:
    card = {"id": model, "object": "model", "created": created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": max_model_len,
            "permission": [{"id": f"modelperm-{uuid.uuid4().int & (2**64 - 1):016x}",
                            "object": "model_permission", "created": created,
                            "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False,
                            "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}  # fmt: skip
    return _ENCODER.encode({"object": "list", "data": [card]})
