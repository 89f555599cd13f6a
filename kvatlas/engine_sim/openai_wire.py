"""The OpenAI API as vLLM 0.33 serves it: request bodies in, replies and SSE chunks out.

Replies carry vLLM's fields in vLLM's order: a whole reply is its pydantic model dumped in full
(``null`` fields included, as its ``JSONResponse`` writes it); a stream chunk only the fields
vLLM sets (``exclude_unset``); the closing usage chunk drops ``null`` fields; every SSE event is
``data: <json>\n\n`` and the stream ends with ``data: [DONE]\n\n``. ``usage`` always carries
``prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``).
Errors are vLLM's ``{"error": {"message", "type", "param", "code"}}``.
``tests/engine_sim/test_openai_api.py`` re-reads every shape with vLLM's own models.
"""

from __future__ import annotations

import uuid
from typing import Any, Final

import msgspec

from kvatlas.checks import is_plain_int
from kvatlas.errors import InvalidInput, NotFound

_ENCODER = msgspec.json.Encoder()


class StreamOptions(msgspec.Struct):
    """Unset fields stay ``UNSET`` (falsy): ``{}`` is told from a set field, as vLLM's check
    (``data.get("stream_options")``) tells an empty object from a non-empty one."""

    include_usage: bool | msgspec.UnsetType | None = msgspec.UNSET
    continuous_usage_stats: bool | msgspec.UnsetType | None = msgspec.UNSET

    def given(self) -> bool:
        return any(v is not msgspec.UNSET for v in msgspec.structs.astuple(self))


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None


class CompletionRequest(msgspec.Struct):
    """The fields the simulation honours; any other field is accepted and ignored (vLLM
    accepts unknown fields too)."""

    prompt: str | list[Any]  # text, token ids, or a one-element list of either
    model: str | None = None
    max_tokens: int | None = 16
    """``null`` is this default too (vLLM's ``normalize_null_max_tokens``): :func:`completion_limit`."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    add_special_tokens: bool = True


class ChatRequest(msgspec.Struct):
    messages: list[ChatMessageIn]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def completion_limit(request: CompletionRequest) -> int:
    """A completion's output limit: ``max_tokens``, its default (16) when ``null``."""
    return 16 if request.max_tokens is None else request.max_tokens


def decode_request(body: bytes, kind: type[Any]) -> Any:
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise InvalidInput(str(exc)) from None
    if request.n != 1:
        raise InvalidInput("n must be 1 (the simulated engine samples one sequence)")
    if request.cache_salt == "":
        raise InvalidInput("Parameter 'cache_salt' must be a non-empty string if provided.")
    if request.stream_options is not None and request.stream_options.given() and not request.stream:
        raise InvalidInput("Stream options can only be defined when `stream=True`. "
                           "(parameter=stream_options)", param="stream_options")  # fmt: skip
    return request


def prompt_of(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids in [0, 2**32)."""
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidInput("one prompt per request (the simulated engine takes no batches)")
        prompt = prompt[0]
    if not prompt:
        raise InvalidInput("prompt cannot be empty")
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(
        is_plain_int(t) and 0 <= t < 1 << 32 for t in prompt
    ):
        raise InvalidInput("prompt must be text or a list of token ids in [0, 2**32)")
    return prompt


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: ``role`` and text ``content`` (text parts
    joined with newlines, vLLM's "string" content format)."""
    if not request.messages:
        raise InvalidInput("messages cannot be empty")
    out = []
    for m in request.messages:
        if m.content is None or isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content or ""})
            continue
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise InvalidInput(f"content part type {part.type!r} is not supported by "
                                   "this text-only model")  # fmt: skip
            texts.append(part.text)
        out.append({"role": m.role, "content": "\n".join(texts)})
    return out


def chat_options(request: ChatRequest) -> dict[str, Any]:
    """How the chat becomes a prompt, as vLLM reads the request (its defaults: the
    generation prompt added, no special tokens beyond the template's)."""
    return {"add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
            "add_special_tokens": request.add_special_tokens,
            "template_kwargs": request.chat_template_kwargs}  # fmt: skip


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise NotFound(f"The model `{requested}` does not exist.")


UNSUPPORTED_MEDIA_TYPE: Final = _ENCODER.encode({"error": {
    "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
    "type": "Bad Request", "param": None, "code": 400}})  # fmt: skip
"""vLLM 0.33's answer (400) to a body not sent as JSON: its ``validate_json_request`` raises a
``RequestValidationError`` that its handler writes with the status's phrase as ``type``."""


def sent_as_json(content_type: str | None, body: bytes) -> bool:
    """Whether vLLM would read the body: its media type is ``application/json`` (vLLM's exact
    test). Without a content type FastAPI decodes the body first, so a body that is not JSON
    gets the decoder's error (``True`` here: the request decoder reports it)."""
    if content_type is None:
        try:
            msgspec.json.decode(body)
        except msgspec.DecodeError:
            return True
        return False
    return content_type.lower().split(";", maxsplit=1)[0] == "application/json"


def error_body(message: str, status: int, param: str | None = None) -> bytes:
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
