"""An OpenAI request body read as vLLM 0.33's server reads it, and refused in its words: the
simulated engine's and the router's (docs/engine-sim.md, docs/router.md).

vLLM's routes are FastAPI's: the body is parsed as JSON when its content type is JSON
(``application/json`` or ``application/*+json``; FastAPI ≥ 0.132 parses nothing else), then
vLLM's ``validate_json_request`` refuses any media type but ``application/json``, then the body
is validated by the request model in pydantic's lax mode (:mod:`kvatlas.vllm_request_models`).
Each refusal is a 400 whose ``type`` says who raised it:

- ``"Bad Request"`` (the status's phrase): FastAPI's ``RequestValidationError`` — JSON that does
  not parse, a media type that is not JSON, a field pydantic refuses — written by vLLM's
  ``validation_exception_handler`` (``vllm/entrypoints/serve/exception_handling/handlers/
  validation.py``): ``"N validation error(s):"`` and one line per error (its dict, ``loc``
  joined with dots), ``param`` the first error's ``loc`` (``body.max_tokens``);
- ``"BadRequestError"``: a ``VLLMValidationError`` raised by one of the model's checks of the
  raw body (``param`` its parameter, the message ending ``(parameter=…)``), or a
  ``TypeError`` one of them hit (``handlers/exception.py``, ``param`` null).

A body that is JSON-typed but not text (not UTF-8, nor UTF-16/32) is FastAPI's own answer,
``{"detail": "There was an error parsing the body"}`` (Starlette's ``HTTPException``, which
vLLM's handler of FastAPI's does not catch): a refusal with ``detail_only`` set.

Messages go through vLLM's ``sanitize_message``. The code below ports those handlers' text
rules line for line; ``tests/engine_sim/test_vllm_validation.py`` compares every answer with
vLLM's own handlers and models.
"""

from __future__ import annotations

import email.message
import json
import re
from typing import Any, Final, Literal

import msgspec

from kvatlas.errors import InvalidInput

BAD_REQUEST: Final = "Bad Request"
"""The ``type`` of a FastAPI-raised refusal (``HTTPStatus.BAD_REQUEST.phrase``)."""
Kind = Literal["completions", "chat"]

_MAX_REPORTED_ERRORS: Final = 10
_MAX_ERROR_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000
_BRACKETED_INTERNAL_RE: Final = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC_MARKERS: Final = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
    "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
    "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
    "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
    "nonetype",
})  # fmt: skip
_UNSUPPORTED_MEDIA_TYPE: Final = "Unsupported Media Type: Only 'application/json' is allowed"
_MISSING: Final = object()
PARSE_ERROR: Final = "There was an error parsing the body"


def refusal(message: str, kind: str = "BadRequestError", param: str | None = None) -> InvalidInput:
    """A 400 as vLLM writes it: ``kind`` is the error object's ``type``."""
    return InvalidInput(sanitize_message(message), param=param, type=kind)


def sanitize_message(message: str) -> str:
    """vLLM's ``sanitize_message``: no memory addresses, tracebacks or file paths."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def _summarize_error_input(value: object) -> object:
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:  # e.g. an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _format_error(err: object) -> str:
    if isinstance(err, dict):
        err = dict(err)
        if "input" in err:
            err["input"] = _summarize_error_input(err["input"])
        loc = err.get("loc")
        if isinstance(loc, tuple | list):
            err["loc"] = clean_loc_for_param(tuple(loc))
    text = str(err)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


def clean_loc_for_param(loc: tuple[Any, ...]) -> str:
    """A pydantic ``loc`` as vLLM's dotted ``param``, without pydantic's internal markers
    (union branches, wrappers): ``("body", "prompt", "list[constrained-int]", 1)`` is
    ``body.prompt.1``."""
    parts = [
        str(p)
        for p in loc
        if not (_BRACKETED_INTERNAL_RE.search(str(p)) or str(p).lower() in _INTERNAL_LOC_MARKERS)
    ]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def validation_refusal(errors: list[Any]) -> InvalidInput:
    """A ``RequestValidationError`` with these errors, as vLLM's handler answers it."""
    param = None
    if errors and isinstance(errors[0], dict) and (loc := errors[0].get("loc")):
        param = clean_loc_for_param(loc)
    count = len(errors)
    label = "error" if count == 1 else "errors"
    reported = errors[:_MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n"
    message += "".join(f"  {_format_error(err)}\n" for err in reported)
    if count > len(reported):
        message += f"  ...and {count - len(reported)} more {label}\n"
    return refusal(message.rstrip(), BAD_REQUEST, param)


def _parsed_as_json(content_type: str | None) -> bool:
    """FastAPI's test of whether it parses a body as JSON (its ``strict_content_type``)."""
    if not content_type:
        return False
    if content_type == "application/json":
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def _loads(body: bytes) -> Any:
    """The body as Starlette's ``json.loads`` reads it (msgspec first: the same values for
    what both read, and the standard library says what msgspec refused: its error, or the
    value, as for ``NaN``)."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        pass
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise validation_refusal([{"type": "json_invalid", "loc": ("body", exc.pos),
                                   "msg": "JSON decode error", "input": {},
                                   "ctx": {"error": exc.msg}}]) from None  # fmt: skip
    except Exception:  # not UTF-8 (nor UTF-16/32), nested too deep: FastAPI's HTTPException
        raise InvalidInput(PARSE_ERROR, detail_only=True) from None


def read_body(body: bytes, content_type: str | None) -> Any:
    """The body's JSON value, or vLLM's refusal, in FastAPI's order: the body parsed (when
    its content type is JSON), then the media type checked, then a missing body refused."""
    value = _loads(body) if body and _parsed_as_json(content_type) else _MISSING
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0]
    if media_type != "application/json":  # vLLM's validate_json_request
        raise validation_refusal([_UNSUPPORTED_MEDIA_TYPE])
    if value is _MISSING:
        raise validation_refusal(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    return value


def validate(kind: Kind, value: Any) -> Any:
    """``value`` (a body's JSON) as vLLM's request model of ``kind`` reads it — a
    :class:`~kvatlas.vllm_request_models.CompletionRequest` or ``ChatRequest`` with pydantic's
    lax coercions applied — or vLLM's refusal."""
    from pydantic import ValidationError  # (on first use: pydantic's import ≈0.1 s)

    from kvatlas import vllm_request_models as models

    model = models.CompletionRequest if kind == "completions" else models.ChatRequest
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise validation_refusal([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
    except models.ValidatorRefusal as exc:
        message = exc.message if exc.param is None else f"{exc.message} (parameter={exc.param})"
        raise refusal(message, param=exc.param) from None
    except TypeError as exc:  # a check that walked what it could not (vLLM's answers it too)
        raise refusal(str(exc)) from None


def read_request(kind: Kind, body: bytes, content_type: str | None) -> Any:
    """:func:`read_body` then :func:`validate`: what vLLM does before its handler runs."""
    return validate(kind, read_body(body, content_type))
