"""What vLLM 0.33 does on the wire that a black-box probe caught engine-sim not doing (real
processes on loopback): a non-streamed request whose client leaves is aborted (vLLM's
``with_cancellation``); an output limit that with the prompt passes the context is cut to what
the prompt leaves, not refused (vLLM's ``get_max_tokens``); a body not sent as JSON is refused
(vLLM's ``validate_json_request``), and so are ``stream_options`` without ``stream``; a
completion's ``"max_tokens": null`` is vLLM's default; a reply's ``id`` is made from the
caller's request id."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import wait_for
from tests.engine_sim.harness import MODEL, EngineProcess, sse_events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streamed_request_whose_client_leaves_is_aborted(path: str) -> None:
    """At ``--speed 1`` 100,000 output tokens take the model about 15 minutes: the request is
    still running when its client gives up, and only its abort frees its slot and blocks."""
    sim = EngineProcess("--speed", "1")
    try:
        free = sim.healthz()["free_blocks"]
        body = {"model": MODEL, "max_tokens": 100_000}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "go on"}]
        else:
            body["prompt"] = [1, 2, 3]
        with pytest.raises(httpx.ReadTimeout):  # the client leaves (its connection closed)
            httpx.post(sim.url + path, json=body, timeout=httpx.Timeout(10, read=0.5))
        assert wait_for(lambda: sim.healthz()["running"] == 0, 60), sim.healthz()
        health = sim.healthz()
        assert health["waiting"] == 0 and health["free_blocks"] == free
        assert health["scheduler"]["generation_tokens"] < 100_000
    finally:
        sim.close()


@pytest.fixture(scope="module")
def short_context() -> Iterator[EngineProcess]:
    sim = EngineProcess("--max-model-len", "256", "--speed", "100")
    yield sim
    sim.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_output_limit_past_the_context_is_clamped_as_vllm_does(
    short_context: EngineProcess, path: str
) -> None:
    """vLLM 0.33 (``get_max_tokens``) serves a prompt that fits with ``max_tokens`` cut to the
    context left (``max_model_len − prompt``), ``finish_reason`` ``length``; it refuses only an
    output limit over the whole context (``TokenizeParams``: param ``max_tokens``) or a prompt
    over it (param ``input_tokens``), each a ``VLLMValidationError`` whose ``str`` (the message)
    ends with its parameter and value."""
    body: dict[str, object] = {"model": MODEL, "max_tokens": 250}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "x" * 100}]
    else:
        body["prompt"] = list(range(100))
    reply = short_context.post(path, body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
    assert reply.json()["choices"][0]["finish_reason"] == "length"

    over = short_context.post(path, {**body, "max_tokens": 257})
    assert over.status_code == 400
    assert over.json()["error"]["param"] == "max_tokens"
    assert over.json()["error"]["message"] == (
        "max_tokens=257 cannot be greater than max_model_len=256. "
        "Please request fewer output tokens. (parameter=max_tokens, value=257)"
    )


def test_a_prompt_past_the_context_is_refused_as_vllm_does(
    short_context: EngineProcess,
) -> None:
    reply = short_context.post("/v1/completions", {"prompt": list(range(300)), "max_tokens": 1})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "input_tokens" and error["type"] == "BadRequestError"
    assert error["message"] == (
        "This model's maximum context length is 256 tokens. However, your prompt contains "
        "300 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=300)"
    )


UNSUPPORTED_MEDIA_TYPE = {
    "error": {
        "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_refused_as_vllm_does(
    short_context: EngineProcess, path: str, content_type: str | None
) -> None:
    """vLLM 0.33's ``validate_json_request`` (a dependency of both routes) refuses a request
    whose content type is not ``application/json`` — curl's ``-d`` without ``-H`` — with
    FastAPI's validation error as vLLM's handler writes it."""
    body: dict[str, object] = {"model": MODEL, "max_tokens": 1}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    headers = {} if content_type is None else {"content-type": content_type}
    reply = short_context.http.post(path, content=json.dumps(body).encode(), headers=headers)
    assert reply.status_code == 400
    assert reply.json() == UNSUPPORTED_MEDIA_TYPE
    sent_as_json = short_context.http.post(
        path, content=json.dumps(body).encode(),
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )  # fmt: skip
    assert sent_as_json.status_code == 200, sent_as_json.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_are_refused_as_vllm_does(
    short_context: EngineProcess, path: str
) -> None:
    """vLLM 0.33's request models refuse ``stream_options`` (any non-empty object) unless
    ``stream`` is true: a ``VLLMValidationError`` raised by a pydantic validator, which its
    handler answers with 400 ``BadRequestError``, ``param`` ``stream_options``."""
    body: dict[str, object] = {"model": MODEL, "max_tokens": 1}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for options in ({"include_usage": True}, {"include_usage": False}):
        reply = short_context.post(path, {**body, "stream_options": options})
        assert reply.status_code == 400, reply.text
        assert reply.json() == {"error": {
            "message": "Stream options can only be defined when `stream=True`. "
                       "(parameter=stream_options)",
            "type": "BadRequestError", "param": "stream_options", "code": 400}}  # fmt: skip
    for allowed in ({**body, "stream_options": {}}, {**body, "stream_options": None},
                    {**body, "stream": False}):  # fmt: skip
        assert short_context.post(path, allowed).status_code == 200


def test_a_completion_with_a_null_max_tokens_gets_vllms_default(
    short_context: EngineProcess,
) -> None:
    """vLLM 0.33's ``CompletionRequest.normalize_null_max_tokens``: ``"max_tokens": null`` is
    the field's default, 16 tokens (``finish_reason`` ``length``), as if it were absent; it is
    not the natural output a chat without a limit gets."""
    for body in ({"prompt": "hi", "max_tokens": None}, {"prompt": "hi"}):
        reply = short_context.post("/v1/completions", body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 16
        assert reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "prefix"), [("/v1/completions", "cmpl-"),
                                              ("/v1/chat/completions", "chatcmpl-")])  # fmt: skip
def test_a_reply_id_is_the_callers_request_id_as_vllm_makes_it(
    short_context: EngineProcess, path: str, prefix: str
) -> None:
    """vLLM 0.33 (``_base_request_id``): a reply's ``id`` is its prefix and the
    ``X-Request-Id`` header, else the body's ``request_id``, else 16 random hex digits; a
    stream's chunks carry it too."""
    body: dict[str, object] = {"model": MODEL, "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    http = short_context.http
    by_header = http.post(path, json=body, headers={"x-request-id": "trace-7"})
    assert by_header.json()["id"] == prefix + "trace-7"
    by_body = http.post(path, json={**body, "request_id": "mine"})
    assert by_body.json()["id"] == prefix + "mine"
    both = http.post(path, json={**body, "request_id": "mine"}, headers={"X-Request-Id": "hdr"})
    assert both.json()["id"] == prefix + "hdr"
    assert re.fullmatch(prefix + "[0-9a-f]{16}", http.post(path, json=body).json()["id"])
    streamed = http.post(path, json={**body, "stream": True}, headers={"x-request-id": "s-1"})
    ids = {json.loads(e)["id"] for e in sse_events(streamed.content)}
    assert ids == {prefix + "s-1"}
