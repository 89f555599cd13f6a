"""``kvatlas engine-sim`` reads and refuses a request body as vLLM 0.33's server does
(:mod:`kvatlas.vllm_requests`): each body below is sent to vLLM's own request models and
exception handlers (tests/vllm_oracle.py) and to a real engine-sim process, and the replies
must be the same — a refusal's status and bytes (``type`` ``"Bad Request"`` and pydantic's
errors for what FastAPI refuses, ``"BadRequestError"`` and ``(parameter=…)`` for vLLM's own
checks), and what pydantic's lax mode accepts (``"max_tokens": 5.0``, ``"stream": "true"``)
served, not refused."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine_sim.harness import EngineProcess, sse_events
from tests.vllm_oracle import READ, vllm_answer
from tests.vllm_support import require_vllm

C, H = "/v1/completions", "/v1/chat/completions"
JSON = "application/json"
HI = b'"messages": [{"role": "user", "content": "hi"}]'


def _chat(extra: bytes) -> bytes:
    return b"{" + HI + (b", " + extra if extra else b"") + b"}"


REFUSED: list[tuple[str, bytes, str | None]] = [
    # the body is not JSON, or not an object, or absent
    (C, b"{not json", JSON), (C, b" ", JSON), (C, b"[1,2]", JSON), (C, b"null", JSON),
    (C, b"", JSON), (C, b'{"prompt": "\xff"}', JSON), (C, b'{"prompt": "x"', JSON),
    # a media type that is not application/json (FastAPI parses only JSON types, first)
    (C, b'{"prompt": "x"}', None), (C, b"{not json", None), (C, b"", "text/plain"),
    (C, b"{not json", "application/vnd.x+json"), (C, b'{"prompt": "x"}', "application/vnd.x+json"),
    (C, b'{"prompt": "x"}', "application/json ; charset=utf-8"),
    # no prompt, an empty one, too many
    (C, b"{}", JSON), (C, b'{"prompt": ""}', JSON), (C, b'{"prompt": null, "max_tokens": 3}', JSON),
    (C, b'{"stream_options": {"include_usage": true}}', JSON),
    (C, b'{"prompt": ' + json.dumps(["a"] * 1025).encode() + b"}", JSON),
    # fields pydantic refuses: its messages, param body.<field>, every union branch listed
    (C, b'{"prompt": [1, -2]}', JSON), (C, b'{"prompt": 5}', JSON), (C, b'{"prompt": [1, "a"]}', JSON),
    (C, b'{"prompt": ' + json.dumps(list(range(-1, -13, -1))).encode() + b"}", JSON),
    (C, b'{"prompt": "x", "max_tokens": "many"}', JSON), (C, b'{"prompt": "x", "max_tokens": 5.5}', JSON),
    (C, b'{"prompt": "x", "max_tokens": 1e400}', JSON), (C, b'{"prompt": "x", "max_tokens": NaN}', JSON),
    (C, b'{"prompt": "x", "stream": "maybe"}', JSON), (C, b'{"prompt": "x", "stream": 2}', JSON),
    (C, b'{"prompt": "x", "n": null}', JSON), (C, b'{"prompt": "x", "add_special_tokens": null}', JSON),
    (C, b'{"prompt": "x", "model": 5}', JSON), (C, b'{"prompt": "x", "request_id": null}', JSON),
    (C, b'{"prompt": "x", "temperature": "hot", "seed": 1e30}', JSON),
    (C, b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', JSON),
    (C, b'{"prompt": 5, "max_tokens": "x", "stream": "z"}', JSON),
    (C, b'{"prompt": "/home/u/secret.txt", "max_tokens": "x"}', JSON),  # vLLM hides paths
    (C, b'{"prompt": "' + b"y" * 300 + b'", "max_tokens": "' + b"z" * 300 + b'"}', JSON),
    (C, b'{"prompt": "x", "stream": true, "stream_options": 5}', JSON),
    (C, b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "x"}}', JSON),
    # vLLM's checks of the raw body, in its order
    (C, b'{"prompt": "x", "cache_salt": ""}', JSON), (C, b'{"prompt": "x", "cache_salt": 5}', JSON),
    (C, b'{"prompt": "x", "cache_salt": "a/b"}', JSON),
    (C, b'{"cache_salt": "", "stream_options": {"include_usage": true}}', JSON),
    (C, b'{"prompt": "x", "stream_options": {"include_usage": true}}', JSON),
    # chat
    (H, b"{}", JSON), (H, b'{"messages": "hi"}', JSON), (H, b'{"messages": null}', JSON),
    (H, b'{"messages": 5}', JSON), (H, _chat(b'"max_tokens": "x"'), JSON),
    (H, _chat(b'"max_completion_tokens": 2.5'), JSON),
    (H, _chat(b'"continue_final_message": true, "add_generation_prompt": true'), JSON),
    (H, _chat(b'"chat_template_kwargs": "x"'), JSON),
    (H, _chat(b'"stream_options": {"include_usage": true}'), JSON), (H, _chat(b'"cache_salt": ""'), JSON),
    (H, _chat(b'"reasoning_effort": "huge"'), JSON), (H, _chat(b'"stream": "nope"'), JSON),
    (H, b'{"messages": [], "documents": [{"a": 1}]}', JSON), (H, b'{"messages": [1]', JSON),
]  # fmt: skip

ACCEPTED: list[tuple[str, bytes]] = [
    (C, b'{"prompt": "x", "max_tokens": 5.0}'), (C, b'{"prompt": "x", "max_tokens": "5"}'),
    (C, b'{"prompt": "x", "max_tokens": true}'), (C, b'{"prompt": [1, true, 2.0], "max_tokens": 2}'),
    (C, b'{"prompt": "x", "stream": "true", "max_tokens": 2}'),
    (C, b'{"prompt": "x", "stream": "yes", "stream_options": {"include_usage": "1"}}'),
    (C, b'{"prompt": "x", "stream": 0.0, "n": "1", "stream_options": {}}'),
    (C, b'{"prompt": [[3, 4]], "max_tokens": 3.0, "ignore_eos": "t"}'),
    (C, b'{"prompt": "x", "stream": null, "cache_salt": "s", "add_special_tokens": "false"}'),
    (C, b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}'),
    (H, _chat(b'"stream": "true", "max_completion_tokens": 3.0')),
    (H, _chat(b'"max_tokens": "4", "n": null, "add_generation_prompt": "off"')),
    (H, _chat(b'"continue_final_message": 1, "add_generation_prompt": 0')),
    (H, b'{"messages": [{"role": "user"}], "max_tokens": 2}'),
]  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    require_vllm("vllm.entrypoints.openai.completion.protocol")
    sim = EngineProcess("--max-model-len", "2048")
    yield sim
    sim.close()


def _send(engine: EngineProcess, path: str, body: bytes, content_type: str | None) -> Any:
    headers = {} if content_type is None else {"content-type": content_type}
    return engine.http.post(path, content=body, headers=headers)


@pytest.mark.parametrize(("path", "body", "content_type"), REFUSED)
def test_a_refused_body_is_answered_as_vllm_answers_it(
    engine: EngineProcess, path: str, body: bytes, content_type: str | None
) -> None:
    expected = vllm_answer(path, body, content_type)
    assert expected.status_code == 400, expected.text  # (the case is one vLLM refuses)
    reply = _send(engine, path, body, content_type)
    assert (reply.status_code, reply.json()) == (400, expected.json())
    assert reply.content == expected.content  # byte for byte, as its JSONResponse writes it
    assert reply.headers["content-type"] == expected.headers["content-type"]


@pytest.mark.parametrize(("path", "body"), ACCEPTED)
def test_what_vllm_coerces_is_served(engine: EngineProcess, path: str, body: bytes) -> None:
    """pydantic's lax mode, as vLLM's models run it: a float without a fraction is an int,
    ``"true"``/``"yes"``/``1`` a boolean, ``true`` the token id 1; the request is served with
    the values vLLM reads."""
    expected = vllm_answer(path, body, JSON)
    assert expected.status_code == 200, expected.text
    read = expected.json()
    reply = _send(engine, path, body, JSON)
    assert reply.status_code == 200, reply.text
    if read["stream"]:
        events = [json.loads(e) for e in sse_events(reply.content)]
        usage = [e["usage"] for e in events if e.get("usage")]
        include = (read["stream_options"] or {}).get("include_usage")
        assert bool(usage) == bool(include)
        generated = sum(1 for e in events if e["choices"] and e["choices"][0].get("finish_reason")
                        is not None)  # fmt: skip
        assert generated == 1
        return
    usage = reply.json()["usage"]
    limit = read.get("max_completion_tokens") or read["max_tokens"]
    if limit is not None:
        assert usage["completion_tokens"] == limit
    if isinstance(read.get("prompt"), list) and isinstance(read["prompt"][0], int):
        assert usage["prompt_tokens"] == len(read["prompt"])


def _named(annotation: Any) -> str:
    """An annotation's repr, classes by their names (``StreamOptions``, whoever defines it)."""
    return re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Z]\w*)", r"\1", repr(annotation))


def test_the_models_mirror_vllms_fields() -> None:
    """Every field of kvatlas's request models has vLLM's annotation, constraints and default,
    and its order (an error list, and ``param``, follow the fields' order)."""
    from kvatlas import vllm_request_models as ours

    completion = require_vllm("vllm.entrypoints.openai.completion.protocol")
    chat = require_vllm("vllm.entrypoints.openai.chat_completion.protocol")
    for mine, theirs in ((ours.CompletionRequest, completion.CompletionRequest),
                         (ours.ChatRequest, chat.ChatCompletionRequest),
                         (ours.StreamOptions, completion.StreamOptions)):  # fmt: skip
        vllm_fields = theirs.model_fields
        names = [n for n in vllm_fields if n in mine.model_fields]
        assert names == list(mine.model_fields), mine  # every field is vLLM's, in its order
        for name in names:
            a, b = mine.model_fields[name], vllm_fields[name]
            if name == "messages":  # each message unchecked here (a remaining difference)
                assert _named(a.annotation) == "list[Any]"
                continue
            assert _named(a.annotation) == _named(b.annotation), (mine, name)
            assert repr(a.metadata) == repr(b.metadata), (mine, name)
            if name != "request_id":  # (vLLM's default is a random id)
                assert a.get_default(call_default_factory=True) == b.get_default(
                    call_default_factory=True
                ), (mine, name)
    for name in READ:
        assert name in ours.CompletionRequest.model_fields or name in ours.ChatRequest.model_fields


@pytest.mark.parametrize(
    ("path", "body", "content_type"), REFUSED + [(p, b, JSON) for p, b in ACCEPTED]
)
def test_the_shared_reader_answers_as_vllm(
    path: str, body: bytes, content_type: str | None
) -> None:
    """:func:`kvatlas.vllm_requests.read_request` (the engine's and the router's) in process:
    the same refusals, and what it accepts read as vLLM reads it."""
    from kvatlas.errors import InvalidInput
    from kvatlas.vllm_requests import read_request

    expected = vllm_answer(path, body, content_type)
    kind = "chat" if path == H else "completions"
    try:
        request = read_request(kind, body, content_type)
    except InvalidInput as exc:
        if exc.extra.get("detail_only"):
            assert expected.json() == {"detail": exc.detail}
            return
        error = {"message": exc.detail, "type": exc.extra.get("type", "BadRequestError"),
                 "param": exc.extra.get("param"), "code": 400}  # fmt: skip
        assert expected.json() == {"error": error}
        return
    assert expected.status_code == 200, expected.text
    fields = {k: v for k, v in request.model_dump(mode="json").items() if k in READ}
    assert fields == expected.json()


EMPTY_PROMPT = {"error": {"message": "The decoder prompt cannot be empty",
                          "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip
"""vLLM 0.33's refusal of a prompt of no tokens, which its request models accept: the input
processor's ``_validate_prompt_len`` (vllm/v1/engine/input_processor.py), a
``VLLMValidationError`` without a parameter."""


@pytest.mark.parametrize(
    ("path", "body"),
    [(C, {"prompt": []}), (C, {"prompt": [[]]}), (C, {"prompt": [""]}),  # (no BOS: bytes)
     (H, {"messages": [], "add_generation_prompt": False})],
)  # fmt: skip
def test_a_prompt_of_no_tokens_is_refused_as_vllm_refuses_it(
    engine: EngineProcess, path: str, body: dict[str, Any]
) -> None:
    assert vllm_answer(path, json.dumps(body).encode(), JSON).status_code == 200  # (models: ok)
    reply = engine.post(path, body)
    assert (reply.status_code, reply.json()) == (400, EMPTY_PROMPT)


def test_a_chat_of_no_messages_is_served_as_vllm_serves_it(engine: EngineProcess) -> None:
    """vLLM's chat route renders an empty ``messages`` through the template: the generation
    prompt alone is a prompt."""
    reply = engine.post(H, {"messages": [], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_an_unknown_model_is_refused_first_as_vllm_refuses_it(engine: EngineProcess) -> None:
    """vLLM 0.33's ``_check_model`` (vllm/entrypoints/serve/engine/serving.py), the first check
    once its models accept the body: 404 ``NotFoundError``, ``param`` ``model``, the served
    names listed; an empty ``model`` is the served one."""
    for body in ({"model": "other", "prompt": "x"}, {"model": "other", "prompt": ["a", "b"]}):
        reply = engine.post(C, body)
        assert (reply.status_code, reply.json()) == (404, {"error": {
            "message": "The model `other` does not exist. Valid aliases: sim.",
            "type": "NotFoundError", "param": "model", "code": 404}})  # fmt: skip
    assert engine.post(C, {"model": "", "prompt": "x", "max_tokens": 1}).status_code == 200
