"""What the router reads of an OpenAI request body, and nothing more: the body itself goes to
the engine unchanged. Every bad input is an :class:`~kvatlas.errors.InvalidInput` (400) that
names what is wrong, never a traceback: in vLLM 0.33's words where vLLM refuses it too (invalid
JSON, a field of the wrong type, no prompt: :func:`parse_request`), in the router's where only
the router must (no model, an empty prompt, a token id past 2^32).

``prompt_tokens`` is what the route is scored with: token ids as given, or text and chat
through :class:`~kvatlas.router.tokenizer.PromptTokenizer`; ``None`` when the router cannot
know them (no tokenizer, multimodal parts): such a request is routed by load and counted.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
import numpy as np

from kvatlas import vllm_requests
from kvatlas.checks import is_plain_int
from kvatlas.errors import InvalidInput
from kvatlas.router.tokenizer import PromptTokenizer
from kvatlas.vllm_limits import empty_prompt, too_few_output_tokens

Kind = Literal["completions", "chat"]
MAX_TOKEN_ID: Final = (1 << 32) - 1
TokenIds = np.ndarray[Any, np.dtype[np.uint32]]
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as the router sees it."""

    kind: Kind
    model: str
    stream: bool
    cache_salt: str
    max_tokens: int | None
    prompt_tokens: TokenIds | None
    """uint32 ids (a token-id prompt is checked and converted in one numpy pass)."""
    untokenized_reason: str | None = None
    """Why ``prompt_tokens`` is ``None``: ``"no_tokenizer"`` or ``"multimodal"``."""
    max_tokens_field: str = "max_tokens"
    """The field ``max_tokens`` came from (a chat's ``max_completion_tokens`` unless null)."""


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInput(f"'{name}' must be a boolean")
    return value


def _token_ids(value: list[Any], where: str) -> TokenIds:
    """``value`` as uint32 ids, or ``InvalidInput``: numpy types the whole list at once (a
    string, float, bool-only or nested item gives another dtype; an int beyond int64 an
    overflow), instead of a Python check per token."""
    if not value:
        raise empty_prompt()  # vLLM's words
    try:
        ids = np.asarray(value)
    except (OverflowError, ValueError):
        ids = np.asarray([], dtype=np.float64)
    integers = (
        ids.ndim == 1
        and ids.dtype.kind in "iu"
        and not any(type(v) is bool for v in value)  # numpy takes True for 1; vLLM does not
    )
    return _in_range(ids, where, integers=integers)


def _in_range(ids: np.ndarray[Any, Any], where: str, *, integers: bool = True) -> TokenIds:
    """``ids`` (``integers``: a 1-d integer array) as uint32, or ``InvalidInput`` naming
    ``where`` when they are not integers or one is outside [0, 2^32): the one range check of
    both paths."""
    if not integers or ids.min() < 0 or ids.max() > MAX_TOKEN_ID:
        raise InvalidInput(f"{where} must be token ids (integers in [0, 2^32))")
    return ids.astype(np.uint32)


def _completion_tokens(
    body: dict[str, Any], tokenizer: PromptTokenizer | None
) -> tuple[TokenIds | None, str | None]:
    """The first prompt's tokens (a batch goes to one engine: its first prompt routes it)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidInput("'prompt' is required")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and is_plain_int(prompt[0]):
        prompts = [prompt]  # token ids (every item is checked below, in one numpy pass)
    elif isinstance(prompt, list):
        prompts = prompt
    else:
        raise InvalidInput("'prompt' must be a string, token ids, or a list of either")
    if not prompts:
        raise empty_prompt()
    checked: list[TokenIds] = []
    for i, item in enumerate(prompts):
        if isinstance(item, str):
            if not item:
                raise InvalidInput(
                    "'prompt' is empty" if len(prompts) == 1 else f"prompt {i} is empty"
                )
        elif isinstance(item, list):
            checked.append(_token_ids(item, "'prompt'" if len(prompts) == 1 else f"prompt {i}"))
        else:
            raise InvalidInput("'prompt' must be a string, token ids, or a list of either")
    first = prompts[0]
    if isinstance(first, list):
        return checked[0], None
    if tokenizer is None:
        return None, "no_tokenizer"
    add_special = _flag(body, "add_special_tokens", True)
    return _ids(tokenizer.encode_text(first, add_special_tokens=add_special)), None


def _ids(tokens: list[int]) -> TokenIds:
    return np.asarray(tokens, dtype=np.uint32)


def _is_multimodal(messages: list[Any]) -> bool:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return True
    return False


def _text_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Text parts joined with newlines (vLLM's "string" content format)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
        out.append(message)
    return out


def _chat_tokens(
    body: dict[str, Any], tokenizer: PromptTokenizer | None
) -> tuple[TokenIds | None, str | None]:
    messages = body.get("messages")
    if not isinstance(messages, list):  # (none at all: rendered, as vLLM's chat route does)
        raise InvalidInput("'messages' must be a list")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidInput("every message must be an object with a 'role'")
    if _is_multimodal(messages):
        return None, "multimodal"
    if tokenizer is None or not tokenizer.has_chat_template:
        return None, "no_tokenizer"
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidInput("'chat_template_kwargs' must be an object")
    tools, documents = body.get("tools"), body.get("documents")
    if tools is not None and not isinstance(tools, list):
        raise InvalidInput("'tools' must be a list")
    if documents is not None and not isinstance(documents, list):
        raise InvalidInput("'documents' must be a list")
    continue_final = _flag(body, "continue_final_message", False)
    tokens = tokenizer.encode_chat(
        _text_messages(messages),
        add_special_tokens=_flag(body, "add_special_tokens", False),
        add_generation_prompt=_flag(body, "add_generation_prompt", not continue_final),
        continue_final_message=continue_final,
        tools=tools,
        documents=documents,
        template_kwargs=kwargs,
    )
    if not tokens:
        raise empty_prompt()
    return _ids(tokens), None


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = _decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput("body must be a JSON object")
    return body


class _TokenIdsCompletion(msgspec.Struct):
    """The fields the router reads of a completion whose prompt is token ids, decoded typed:
    msgspec checks every id is an integer in C, ``array('I')`` the range (≈ a fifth of the
    general path's CPU for a 4,096-token prompt). Anything else takes the general path."""

    prompt: list[int]
    model: Any = None
    stream: Any = None
    cache_salt: Any = None
    max_tokens: Any = None


_token_ids_decoder = msgspec.json.Decoder(_TokenIdsCompletion)


def _token_ids_body(raw: bytes) -> tuple[dict[str, Any], TokenIds] | None:
    try:
        view = _token_ids_decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None  # not this shape (or not JSON): the general path says what is wrong
    if not view.prompt:
        return None
    try:  # array('I') range-checks every id in C: a third of numpy's fromiter + min/max
        checked: TokenIds = np.frombuffer(array("I", view.prompt), dtype=np.uint32)
    except OverflowError:
        raise InvalidInput("'prompt' must be token ids (integers in [0, 2^32))") from None
    fields = ("model", "stream", "cache_salt", "max_tokens")
    body = {name: value for name in fields if (value := getattr(view, name)) is not None}
    return body, checked


def parse_request(kind: Kind, raw: bytes, tokenizer: PromptTokenizer | None) -> RouteRequest:
    """The routing view of a ``/v1/completions`` or ``/v1/chat/completions`` body.

    A body the router's own reading refuses is read again as vLLM's server reads it
    (:mod:`kvatlas.vllm_requests`, pydantic on this path only): what vLLM refuses (JSON that
    does not parse, a field of the wrong type, no prompt) is refused in vLLM's words, ``type``
    and ``param``; what its lax mode coerces (``"stream": "true"``, ``"max_tokens": 5.0``, a
    token id ``true``) is routed by the values vLLM reads, the body still sent unchanged; what
    vLLM accepts but the router cannot route (no ``model``, a token id past 2^32) keeps the
    router's own refusal."""
    try:
        return _parse(kind, raw, tokenizer)
    except InvalidInput:
        as_vllm_reads_it = _coerced(kind, raw)  # or vLLM's refusal
        return _parse(kind, as_vllm_reads_it, tokenizer)  # (its refusal again: the router's)


def _coerced(kind: Kind, raw: bytes) -> bytes:
    """The body's fields as vLLM's request model reads them, as JSON; vLLM's refusal when
    its model refuses them. Every body is read as JSON (the router sends one without a
    content type as ``application/json``)."""
    request = vllm_requests.read_request(kind, raw, "application/json")
    return _encoder.encode(request.model_dump(mode="json", exclude_unset=True))


def _parse(kind: Kind, raw: bytes, tokenizer: PromptTokenizer | None) -> RouteRequest:
    fast = _token_ids_body(raw) if kind == "completions" else None
    body = fast[0] if fast is not None else decode_body(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("'model' is required")
    salt = body.get("cache_salt")
    if salt is None:
        salt = ""
    if not isinstance(salt, str):
        raise InvalidInput("'cache_salt' must be a string")
    # as vLLM reads them: a chat's max_completion_tokens unless null, else max_tokens (a
    # completion has no max_completion_tokens: vLLM's CompletionRequest ignores it)
    limit = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        limit = "max_completion_tokens"
    max_tokens = body.get(limit)
    if max_tokens is not None and not is_plain_int(max_tokens):
        raise InvalidInput(f"'{limit}' must be an integer")  # (read again as vLLM reads it)
    if max_tokens is not None and max_tokens < 0:  # what vLLM's SamplingParams answers
        raise too_few_output_tokens(max_tokens)
    tokens: TokenIds | None
    if fast is not None:
        tokens, reason = fast[1], None
    elif kind == "completions":
        tokens, reason = _completion_tokens(body, tokenizer)
    else:
        tokens, reason = _chat_tokens(body, tokenizer)
    return RouteRequest(
        kind, model, _flag(body, "stream", False), salt, max_tokens, tokens, reason, limit
    )
