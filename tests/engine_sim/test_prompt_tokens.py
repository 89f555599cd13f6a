"""engine-sim's prompt tokens are vLLM's for the same body, flags included (a real process):
``add_special_tokens`` (completions and chat), ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``, against transformers (what vLLM calls)
and the router (``--chat-template`` the engine's ChatML template). Each case's ids are checked
through the cache: the same ids sent as a token-id prompt reuse all but the last one (blocks of
one token, the case's own salt)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvatlas.router import PromptTokenizer, parse_request
from tests.engine_sim.harness import EngineProcess
from tests.router.fake_vllm import load_hf_tokenizer
from tests.router.tokenizer_support import train_tokenizer

CHATML = (  # docs/engine-sim.md, "Tokens": what a router's --chat-template must be
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief, café"},
    {"role": "user", "content": "the quick brown fox?"},
    {"role": "assistant", "content": "jumps over"},
]
TEXT = "the quick brown fox jumps over the lazy dog"
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": TEXT}),
    ("completions", {"prompt": TEXT, "add_special_tokens": False}),
    ("chat", {"messages": MESSAGES}),
    ("chat", {"messages": MESSAGES, "add_generation_prompt": False}),
    (
        "chat",
        {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
    ),
    ("chat", {"messages": MESSAGES, "add_special_tokens": True}),
    ("chat", {"messages": MESSAGES, "chat_template_kwargs": {"thinking": True}}),
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = train_tokenizer(tmp_path_factory.mktemp("tok"))
    (directory / "chatml.jinja").write_text(CHATML)
    return directory


@pytest.fixture(scope="module")
def engine(directory: Path) -> Iterator[EngineProcess]:
    sim = EngineProcess("--tokenizer", str(directory / "tokenizer.json"), "--block-size", "1")
    yield sim
    sim.close()


def vllm_tokens(hf: Any, kind: str, body: dict[str, Any]) -> list[int]:
    """What vLLM 0.33 computes: ``tokenizer(prompt, add_special_tokens=...)`` for completions,
    ``apply_chat_template`` then ``add_special_tokens`` (default false) for chat."""
    if kind == "completions":
        return list(
            hf(body["prompt"], add_special_tokens=body.get("add_special_tokens", True)).input_ids
        )
    text = hf.apply_chat_template(
        body["messages"], chat_template=CHATML, tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        **(body.get("chat_template_kwargs") or {}),
    )  # fmt: skip
    return list(hf(text, add_special_tokens=body.get("add_special_tokens", False)).input_ids)


@pytest.mark.parametrize(("case", "kind", "body"), [(i, *b) for i, b in enumerate(BODIES)])
def test_prompt_tokens_are_vllms_and_the_routers(
    engine: EngineProcess, directory: Path, case: int, kind: str, body: dict[str, Any]
) -> None:
    expected = vllm_tokens(load_hf_tokenizer(directory), kind, body)
    router = PromptTokenizer(directory / "tokenizer.json", directory / "chatml.jinja")
    routed = parse_request(kind, json.dumps({"model": "m", **body}).encode(), router)  # type: ignore[arg-type]
    assert routed.prompt_tokens is not None and routed.prompt_tokens.tolist() == expected
    salt = f"case-{case}"
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    reply = engine.post(path, {**body, "max_tokens": 1, "cache_salt": salt})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(expected)
    again = engine.complete(expected, 1, cache_salt=salt)  # the same ids: all but one reused
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(expected) - 1


def test_chat_flags_without_a_tokenizer() -> None:
    """One token per UTF-8 byte: the flags change the rendered ChatML as they do with one."""
    sim = EngineProcess()
    try:
        ask = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]

        def prompt_tokens(**flags: Any) -> int:
            reply = sim.post("/v1/chat/completions", {"messages": ask, "max_tokens": 1, **flags})
            assert reply.status_code == 200, reply.text
            return int(reply.json()["usage"]["prompt_tokens"])

        whole = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        assert prompt_tokens() == len(whole) + len("<|im_start|>assistant\n")
        assert prompt_tokens(add_generation_prompt=False) == len(whole)
        continued = prompt_tokens(continue_final_message=True, add_generation_prompt=False)
        assert continued == len(whole) - len("<|im_end|>\n")
    finally:
        sim.close()
