"""The router refuses what it reads of a body in vLLM 0.33's words, and routes what vLLM's lax
mode accepts (docs/router.md): each body is sent to vLLM's own request models and exception
handlers (tests/vllm_oracle.py) and read by :func:`kvatlas.router.openai_body.parse_request`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvatlas.errors import InvalidInput
from kvatlas.router.openai_body import parse_request
from tests.vllm_oracle import vllm_answer

JSON = "application/json"
M = b'"model": "m"'
HI = b'"messages": [{"role": "user", "content": "hi"}]'


def _body(*fields: bytes) -> bytes:
    return b"{" + b", ".join((M, *fields)) + b"}"


REFUSED: list[tuple[str, bytes]] = [  # a field the router reads (others: the engine answers)
    ("completions", b"{not json"), ("completions", b"[1, 2]"), ("completions", b" "),
    ("completions", b'{"model": "m", "prompt": [1]'),
    ("completions", _body()), ("completions", _body(b'"prompt": ""')),
    ("completions", _body(b'"prompt": null')), ("completions", _body(b'"prompt": 5')),
    ("completions", _body(b'"prompt": [1, -2]')), ("completions", _body(b'"prompt": [1, 2.5]')),
    ("completions", _body(b'"prompt": [1, [2]]')),
    ("completions", _body(b'"prompt": [[-1]]')),
    ("completions", _body(b'"prompt": [1]', b'"max_tokens": "many"')),
    ("completions", _body(b'"prompt": [1]', b'"max_tokens": 5.5')),
    ("completions", _body(b'"prompt": [1]', b'"stream": "maybe"')),
    ("completions", _body(b'"prompt": [1]', b'"cache_salt": 5')),
    ("completions", b'{"model": 5, "prompt": [1]}'),
    ("chat", _body()), ("chat", _body(b'"messages": "hi"')), ("chat", _body(b'"messages": null')),
    ("chat", _body(HI, b'"max_completion_tokens": "x"')),
    ("chat", _body(HI, b'"stream": 2')),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "raw"), REFUSED)
def test_what_vllm_refuses_is_refused_in_its_words(kind: str, raw: bytes) -> None:
    expected = vllm_answer("/v1/chat/completions" if kind == "chat" else "/v1/completions",
                           raw, JSON)  # fmt: skip
    assert expected.status_code == 400, expected.text
    with pytest.raises(InvalidInput) as refused:
        parse_request(kind, raw, None)  # type: ignore[arg-type]
    exc = refused.value
    error = {"message": exc.detail, "type": exc.extra.get("type", "BadRequestError"),
             "param": exc.extra.get("param"), "code": 400}  # fmt: skip
    assert expected.json() == {"error": error}


ACCEPTED: list[tuple[str, bytes, dict[str, Any]]] = [
    ("completions", _body(b'"prompt": [1, true, 2.0]'), {"prompt_tokens": [1, 1, 2]}),
    ("completions", _body(b'"prompt": [1, "2"]'), {"prompt_tokens": [1, 2]}),
    ("completions", _body(b'"prompt": [[3, 4]]', b'"stream": "true"'), {"stream": True}),
    ("completions", _body(b'"prompt": [1]', b'"max_tokens": 5.0'), {"max_tokens": 5}),
    ("completions", _body(b'"prompt": [1]', b'"max_tokens": "7", "stream": 1'),
     {"max_tokens": 7, "stream": True}),
    ("completions", _body(b'"prompt": [1]', b'"max_tokens": true, "stream": "off"'),
     {"max_tokens": 1, "stream": False}),
    ("chat", _body(b'"messages": []'), {"prompt_tokens": None}),  # vLLM renders no messages
    ("chat", _body(HI, b'"max_completion_tokens": 3.0, "stream": "yes"'),
     {"max_tokens": 3, "max_tokens_field": "max_completion_tokens", "stream": True}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "raw", "read"), ACCEPTED)
def test_what_vllm_coerces_is_routed_by_the_values_vllm_reads(
    kind: str, raw: bytes, read: dict[str, Any]
) -> None:
    expected = vllm_answer("/v1/chat/completions" if kind == "chat" else "/v1/completions",
                           raw, JSON)  # fmt: skip
    assert expected.status_code == 200, expected.text
    req = parse_request(kind, raw, None)  # type: ignore[arg-type]
    got = {
        "prompt_tokens": None if req.prompt_tokens is None else req.prompt_tokens.tolist(),
        "stream": req.stream, "max_tokens": req.max_tokens,
        "max_tokens_field": req.max_tokens_field,
    }  # fmt: skip
    assert {k: got[k] for k in read} == read
    if kind == "completions" and "prompt_tokens" in read:
        assert expected.json()["prompt"] == read["prompt_tokens"]
    assert json.loads(raw)["model"] == req.model


def test_a_negative_output_limit_is_refused_as_vllm_refuses_it() -> None:
    """vLLM's models accept ``"max_tokens": -1``; its ``SamplingParams`` then refuse it."""
    with pytest.raises(InvalidInput) as refused:
        parse_request("completions", _body(b'"prompt": [1]', b'"max_tokens": -1'), None)
    assert refused.value.detail == (
        "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"
    )
    assert refused.value.extra == {"param": "max_tokens"}


@pytest.mark.parametrize(
    "raw", [_body(b'"prompt": []'), _body(b'"prompt": [[]]'), _body(b'"prompt": [[1], []]')]
)
def test_a_prompt_of_no_tokens_is_refused_as_vllm_refuses_it(raw: bytes) -> None:
    """vLLM's input processor (``_validate_prompt_len``): ``The decoder prompt cannot be
    empty``, no ``param`` (its models accept the body)."""
    assert vllm_answer("/v1/completions", raw, JSON).status_code == 200
    with pytest.raises(InvalidInput) as refused:
        parse_request("completions", raw, None)
    assert (refused.value.detail, refused.value.extra) == ("The decoder prompt cannot be empty", {})
