"""``kvatlas engine-sim`` on its OpenAI surface, against a real process on loopback: every reply
and stream chunk re-read with vLLM 0.33.0's own pydantic models and dumped as vLLM dumps it
gives back our bytes; SSE framing; ``cached_tokens`` of a repeated prompt; vLLM's metric names;
bad input answered with OpenAI error objects."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.engine_sim.harness import MODEL, EngineProcess, compact, sse_events
from tests.vllm_support import require_vllm

BS = 16
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    sim = EngineProcess("--gpu-blocks", "512", "--max-model-len", "2048")
    yield sim
    sim.close()


@pytest.fixture(scope="module")
def completion_models() -> ModuleType:
    return require_vllm("vllm.entrypoints.openai.completion.protocol")


@pytest.fixture(scope="module")
def chat_models() -> ModuleType:
    return require_vllm("vllm.entrypoints.openai.chat_completion.protocol")


def as_vllm_dumps_it(model: Any, raw: bytes, **dump: Any) -> bytes:
    parsed = model.model_validate_json(raw)
    if not dump:  # a whole reply: JSONResponse(content=model.model_dump())
        return compact(parsed.model_dump(mode="json"))
    return str(parsed.model_dump_json(**dump)).encode()


def test_completion_reply_is_vllms_and_reports_cached_tokens(
    engine: EngineProcess, completion_models: ModuleType
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 8 full blocks
    first = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    assert as_vllm_dumps_it(completion_models.CompletionResponse, first.content) == first.content
    body = first.json()
    assert body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 135, "total_tokens": 139, "completion_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0,
                                                       "created_cache_tokens": None,
                                                       "multimodal_tokens": None},
                             "completion_tokens_details": None}  # fmt: skip
    again = engine.complete(prompt, 4)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BS
    assert again["choices"][0]["text"] == body["choices"][0]["text"]  # same prompt, same output
    # the same prompt as token ids (one per UTF-8 byte without --tokenizer): the same blocks
    ids = list(prompt.encode())
    by_ids = engine.complete(ids, 1)
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BS
    assert engine.complete([ids], 1)["usage"]["prompt_tokens"] == 135  # a batch of one


def test_a_salted_prompt_shares_nothing_with_the_unsalted_one(engine: EngineProcess) -> None:
    prompt = "salted prompts have their own chain of block hashes! " * 2
    engine.complete(prompt, 1)
    salted = engine.complete(prompt, 1, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (
        engine.complete(prompt, 1, cache_salt="tenant-a")["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        == (len(prompt) - 1) // BS * BS
    )


COMPLETION_CHUNK_KEYS = ["id", "object", "created", "model", "choices", "kv_transfer_params"]
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason",
                          "prompt_token_ids", "token_ids", "weight_versions"]  # fmt: skip


def test_completion_stream_is_framed_as_vllm_frames_it(
    engine: EngineProcess, completion_models: ModuleType
) -> None:
    prompt = "stream me a few tokens, please, and then a usage chunk"
    engine.complete(prompt, 1)  # warm: the streamed one reuses its blocks
    with engine.http.stream("POST", "/v1/completions", json={
        "prompt": prompt, "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}}) as reply:  # fmt: skip
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read()
    events = sse_events(raw)
    tokens, usage = events[:-1], events[-1]
    assert len(tokens) == 5
    model = completion_models.CompletionStreamResponse
    for i, chunk in enumerate(tokens):
        assert as_vllm_dumps_it(model, chunk, exclude_unset=True) == chunk
        parsed = json.loads(chunk)
        assert list(parsed) == COMPLETION_CHUNK_KEYS
        assert list(parsed["choices"][0]) == COMPLETION_CHOICE_KEYS
        assert parsed["choices"][0]["finish_reason"] == ("length" if i == 4 else None)
    assert as_vllm_dumps_it(model, usage, exclude_unset=False, exclude_none=True) == usage
    assert json.loads(usage)["choices"] == []
    assert json.loads(usage)["usage"] == {
        "prompt_tokens": len(prompt), "total_tokens": len(prompt) + 5, "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": (len(prompt) - 1) // BS * BS}}  # fmt: skip
    # without include_usage: tokens then [DONE], no usage chunk (as vLLM)
    plain = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "stream": True})
    assert [json.loads(e)["choices"][0]["finish_reason"] for e in sse_events(plain.content)] == [
        None, "length"]  # fmt: skip


def test_chat_reply_and_stream_are_vllms(engine: EngineProcess, chat_models: ModuleType) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]  # fmt: skip
    reply = engine.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3})
    assert reply.status_code == 200
    assert as_vllm_dumps_it(chat_models.ChatCompletionResponse, reply.content) == reply.content
    body = reply.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    # without max_tokens the model "stops" by itself after --natural-output-tokens
    natural = engine.post("/v1/chat/completions", {"messages": messages}).json()
    assert natural["choices"][0]["finish_reason"] == "stop"
    assert natural["usage"]["completion_tokens"] == 128
    assert natural["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same template
    raw = engine.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                "stream": True,
                                                "stream_options": {"include_usage": True}}).content  # fmt: skip
    events = sse_events(raw)
    model = chat_models.ChatCompletionStreamResponse
    role, tokens, usage = events[0], events[1:-1], events[-1]
    assert json.loads(role)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(tokens) == 3
    for chunk in [role, *tokens]:
        assert as_vllm_dumps_it(model, chunk, exclude_unset=True) == chunk
    assert json.loads(tokens[-1])["choices"][0]["finish_reason"] == "length"
    assert as_vllm_dumps_it(model, usage, exclude_unset=True, exclude_none=True) == usage
    assert json.loads(usage)["usage"]["completion_tokens"] == 3


def test_chat_stream_with_continuous_usage_is_vllms(
    engine: EngineProcess, chat_models: ModuleType
) -> None:
    """``stream_options.continuous_usage_stats``: every chunk, the role chunk too, carries
    the usage vLLM's chat stream builds (``completion_tokens_details`` null included),
    rebuilt here as vLLM's serving code builds it."""
    m = chat_models
    options = {"include_usage": True, "continuous_usage_stats": True}
    raw = engine.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "stream": True,
                                                "stream_options": options}).content  # fmt: skip
    role, *tokens, _ = sse_events(raw)
    first = json.loads(role)
    assert "usage" in first, role
    n = first["usage"]["prompt_tokens"]
    chunk = m.ChatCompletionStreamResponse(
        id=first["id"], object="chat.completion.chunk", created=first["created"], model=MODEL,
        choices=[m.ChatCompletionResponseStreamChoice(
            index=0, delta=m.DeltaMessage(role="assistant", content=""), logprobs=None,
            finish_reason=None)],
        prompt_token_ids=None, prompt_text=None,
    )  # fmt: skip
    chunk.usage = m.UsageInfo(prompt_tokens=n, completion_tokens=0, total_tokens=n,
                              completion_tokens_details=None)  # fmt: skip
    assert chunk.model_dump_json(exclude_unset=True).encode() == role
    for i, got in enumerate(tokens, 1):
        last = i == len(tokens)
        extra = {"finish_reason": "length", "stop_reason": None, "weight_versions": None}
        choice = m.ChatCompletionResponseStreamChoice(
            index=0, delta=m.DeltaMessage(content=json.loads(got)["choices"][0]["delta"]["content"]),
            logprobs=None, token_ids=None, **(extra if last else {"finish_reason": None}),
        )  # fmt: skip
        chunk = m.ChatCompletionStreamResponse(id=first["id"], object="chat.completion.chunk",
                                               created=first["created"], choices=[choice],
                                               model=MODEL, kv_transfer_params=None)  # fmt: skip
        chunk.usage = m.UsageInfo(prompt_tokens=n, completion_tokens=i, total_tokens=n + i,
                                  completion_tokens_details=None)  # fmt: skip
        assert chunk.model_dump_json(exclude_unset=True).encode() == got


def test_models_and_health(engine: EngineProcess) -> None:
    models = engine.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    assert models["data"][0]["owned_by"] == "vllm"
    assert engine.http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{}", 400),  # no prompt
        ("/v1/completions", {"prompt": ""}, 400),
        ("/v1/completions", {"prompt": []}, 400),
        ("/v1/completions", {"prompt": [1, 2**40]}, 400),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400),  # batches are not simulated
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400),
        ("/v1/completions", {"prompt": "x" * 2049, "max_tokens": 1}, 400),  # > max-model-len
        ("/v1/completions", {"prompt": "x", "max_tokens": 2049}, 400),  # > max-model-len
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            400,
        ),
        # vLLM: max_completion_tokens unless null (0 is no output: refused), else max_tokens
        ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, 400),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_completion_tokens": 0, "max_tokens": 5},
            400,
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
            400,
        ),
    ],
)
def test_bad_input_is_an_openai_error_object(
    engine: EngineProcess, path: str, body: dict[str, Any] | bytes, status: int
) -> None:
    """What vLLM's checks refuse past its request models (a body its models refuse, vLLM's
    ``"Bad Request"`` answers: test_vllm_validation.py) or the simulation cannot serve."""
    reply = engine.post(path, body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["code"] == status and error["message"]
    assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")


@pytest.mark.parametrize(
    ("method", "path", "status", "detail"),
    [
        ("GET", "/no/such/path", 404, "Not Found"),
        ("POST", "/v1/model", 404, "Not Found"),
        ("GET", "/v1/completions", 405, "Method Not Allowed"),
        ("DELETE", "/v1/chat/completions", 405, "Method Not Allowed"),
    ],
)
def test_unknown_paths_and_methods_are_answered_as_fastapi_answers(
    engine: EngineProcess, method: str, path: str, status: int, detail: str
) -> None:
    """vLLM's server is FastAPI: an unknown path or a wrong method is its JSON ``detail``."""
    reply = engine.http.request(method, path)
    assert reply.status_code == status
    assert reply.headers["content-type"] == "application/json"
    assert reply.content == compact({"detail": detail})
    if status == 405:
        assert reply.headers["allow"] == "POST"


def test_metrics_carry_vllms_names(engine: EngineProcess) -> None:
    loggers = Path(require_vllm("vllm.v1.metrics.loggers").__file__ or "").read_text()
    vllm_names = set(re.findall(r'name="(vllm:[a-z_]+)"', loggers))
    before = engine.healthz()["scheduler"]
    prompt = "metrics follow the engine's own counts, " * 2
    engine.complete(prompt, 2)
    engine.complete(prompt, 2)
    text = engine.http.get("/metrics").text
    # prometheus_client (vLLM's exporter too) types a counter as NAME_total, plus NAME_created
    families = {re.sub(r"_(total|created)$", "", n)
                for n in re.findall(r"^# TYPE (vllm:[a-z_]+) ", text, re.M)}  # fmt: skip
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds", "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits"} <= families  # fmt: skip
    assert families <= vllm_names, families - vllm_names  # every name is one vLLM 0.33 exports

    def value(name: str) -> float:
        found = re.search(
            rf'^{re.escape(name)}{{engine="0",model_name="{MODEL}"}} (\S+)$', text, re.M
        )
        assert found, name
        return float(found.group(1))

    after = engine.healthz()["scheduler"]
    assert value("vllm:prefix_cache_queries_total") == after["prefix_queries"]
    assert (
        value("vllm:prefix_cache_hits_total") - before["prefix_hits"]
        >= (len(prompt) - 1) // BS * BS
    )
    assert value("vllm:num_requests_running") == 0 and value("vllm:kv_cache_usage_perc") == 0
    assert value("vllm:time_to_first_token_seconds_count") >= 2


def test_text_is_tokenized_by_the_given_tokenizer_json(tmp_path: Path) -> None:
    """``--tokenizer``: a Hugging Face tokenizer.json (a tiny word-level one, built here)."""
    import tokenizers  # a kvatlas dependency

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    sim = EngineProcess("--tokenizer", str(path), "--block-size", "4")
    try:
        text = "hello world " * 10  # 20 words → 20 tokens (the byte fallback would give 120)
        first = sim.complete(text, 2)
        assert first["usage"]["prompt_tokens"] == 20
        assert sim.complete(text, 2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        # the same tokens given as ids reuse the same blocks
        as_ids = sim.complete([1, 2] * 10, 1)
        assert as_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        assert sim.healthz()["tokenizer"] == "tokenizer.json"
    finally:
        sim.close()


def test_time_to_first_token_is_never_less_than_the_model_says(engine: EngineProcess) -> None:
    """``--speed 1000``: the TTFT histogram (model seconds) of a cold 2,000-token prompt is at
    least its one prefill step's modelled time — the clock never runs ahead of the model (the
    upper side is wall-clock noise and not asserted)."""
    from kvatlas.engine_sim import CostModel

    def ttft_sum() -> float:
        text = engine.http.get("/metrics").text
        found = re.search(r"^vllm:time_to_first_token_seconds_sum\{[^}]*\} (\S+)$", text, re.M)
        assert found
        return float(found.group(1))

    before = ttft_sum()
    engine.complete(list(range(7, 2007)), 1)  # 2,000 tokens no earlier prompt shares
    modelled = CostModel().step_seconds(2000, 2000 * 2001 // 2, 0, 0)
    assert ttft_sum() - before >= modelled > 0.05
