"""The router's token ids equal the engine's for the same body (issue 26 item 2): a tokenizer
trained on the spot, loaded by the router (``tokenizers`` + its own Jinja environment) and by
transformers (what vLLM calls: ``tokenizer(prompt)`` for completions, ``apply_chat_template``
then ``add_special_tokens=False`` for chat). A wrong BOS, a missed ``add_generation_prompt``
or a template rendered without ``trim_blocks`` would shift every key and fail here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvatlas.errors import InvalidInput
from kvatlas.router import PromptTokenizer, parse_request
from tests.router.fake_vllm import FakeVllm, load_hf_tokenizer
from tests.router.tokenizer_support import CHAT_TEMPLATE, train_tokenizer

MESSAGES = [
    {"role": "system", "content": "be brief, café"},
    {"role": "user", "content": "the quick brown fox?"},
    {"role": "assistant", "content": "jumps over"},
    {"role": "user", "content": "and the lazy dog"},
]
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": "the quick brown fox jumps"}),
    ("completions", {"prompt": "the quick brown fox jumps", "add_special_tokens": False}),
    ("completions", {"prompt": "  système <|user|> hello\n\tdog "}),
    ("chat", {"messages": MESSAGES}),
    ("chat", {"messages": MESSAGES, "add_generation_prompt": False}),
    (
        "chat",
        {
            "messages": [*MESSAGES[:1], {"role": "user", "content": "x"}],
            "chat_template_kwargs": {"thinking": True},
        },
    ),
    (
        "chat",
        {"messages": MESSAGES[:3], "continue_final_message": True, "add_generation_prompt": False},
    ),
    ("chat", {"messages": MESSAGES, "add_special_tokens": True}),
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizers(directory: Path) -> tuple[PromptTokenizer, Any]:
    return PromptTokenizer(directory), load_hf_tokenizer(directory)


@pytest.mark.parametrize(("kind", "body"), BODIES)
def test_router_tokens_equal_the_engines(
    tokenizers: tuple[PromptTokenizer, Any], kind: str, body: dict[str, Any]
) -> None:
    ours, hf = tokenizers
    full = {"model": "toy", **body}
    engine = FakeVllm.__new__(FakeVllm)  # only its tokenization (no server)
    engine.tokenizer = hf
    expected = engine._tokens(f"/v1/{'chat/' if kind == 'chat' else ''}completions", full)
    got = parse_request(kind, json.dumps(full).encode(), ours).prompt_tokens  # type: ignore[arg-type]
    assert got is not None and got.tolist() == expected
    assert len(expected) > 3


def test_template_file_and_tokenizer_file(
    tokenizers: tuple[PromptTokenizer, Any], directory: Path, tmp_path: Path
) -> None:
    """--tokenizer FILE + --chat-template FILE (.jinja, or a tokenizer_config.json): the same
    ids as the directory form (special tokens from the tokenizer_config.json beside the file)."""
    ours, _ = tokenizers
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    for source in (template, directory / "tokenizer_config.json"):
        other = PromptTokenizer(directory / "tokenizer.json", source)
        assert other.encode_chat(MESSAGES) == ours.encode_chat(MESSAGES)


def test_template_errors_are_400s(tokenizers: tuple[PromptTokenizer, Any]) -> None:
    ours, _ = tokenizers
    late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(InvalidInput, match="system first"):
        parse_request("chat", json.dumps({"model": "m", "messages": late_system}).encode(), ours)
    both = {"model": "m", "messages": MESSAGES, "continue_final_message": True}
    both["add_generation_prompt"] = True
    with pytest.raises(InvalidInput, match="Cannot set both"):  # vLLM's check, its words
        parse_request("chat", json.dumps(both).encode(), ours)


@pytest.mark.parametrize(
    ("kind", "raw", "message"),
    [
        # what vLLM's request models refuse, in its words (tests/router/test_vllm_validation.py)
        ("completions", b"{not json", "JSON decode error"),
        ("completions", b"[1, 2]", "valid dictionary"),
        ("completions", b'{"prompt": "x"}', "'model' is required"),
        ("completions", b'{"model": "m", "prompt": ""}', "empty"),
        ("completions", b'{"model": "m", "prompt": []}', "empty"),
        ("completions", b'{"model": "m", "prompt": [1, -2]}', "greater than or equal to 0"),
        ("completions", b'{"model": "m", "prompt": [1, 4294967296]}', "token ids"),
        ("completions", b'{"model": "m", "prompt": [1, 2.5]}', "fractional part"),
        ("completions", b'{"model": "m", "prompt": [1, 18446744073709551616]}', "token ids"),
        ("completions", b'{"model": "m", "prompt": [1, [2]]}', "validation errors"),
        ("completions", b'{"model": "m", "prompt": [1, 99999999999999999999999]}', "token ids"),
        ("completions", b'{"model": "m", "prompt": [[1], []]}', "decoder prompt cannot be empty"),
        ("completions", b'{"model": "m", "prompt": [[1], [4294967296]]}', "prompt 1 must be token"),
        ("completions", b'{"model": "m", "prompt": [[-1]]}', "greater than or equal to 0"),
        ("completions", b'{"model": "m"}', "Either prompt or prompt_embeds"),
        ("completions", b'{"model": "m", "prompt": [1], "cache_salt": 5}', "cache_salt"),
        ("completions", b'{"model": "m", "prompt": [1], "stream": "maybe"}', "body.stream"),
        ("completions", b'{"model": "m", "prompt": [1], "max_tokens": -1}', "max_tokens"),
        ("chat", b'{"model": "m", "messages": [{"content": "x"}]}', "role"),
    ],
)
def test_bad_bodies_are_named(kind: str, raw: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_request(kind, raw, None)  # type: ignore[arg-type]


def test_token_ids_need_no_tokenizer_and_text_without_one_is_counted() -> None:
    req = parse_request(
        "completions", b'{"model": "m", "prompt": [5, 6, 7], "cache_salt": "t"}', None
    )
    assert req.prompt_tokens is not None and req.prompt_tokens.tolist() == [5, 6, 7]
    assert (req.cache_salt, req.untokenized_reason) == ("t", None)
    text = parse_request("completions", b'{"model": "m", "prompt": "hi"}', None)
    assert (text.prompt_tokens, text.untokenized_reason) == (None, "no_tokenizer")
    image = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}  # fmt: skip
    mm = parse_request("chat", json.dumps(image).encode(), None)
    assert (mm.prompt_tokens, mm.untokenized_reason) == (None, "multimodal")


def test_the_typed_fast_path_agrees_with_the_general_one() -> None:
    """Token-id completions take a typed decode; the general path (any body) must read the
    same ids, salt, stream flag and max_tokens."""
    from kvatlas.router.openai_body import _completion_tokens, _token_ids_body, decode_body

    raw = json.dumps({"model": "m", "prompt": [0, 7, 2**32 - 1, 128255], "stream": True,
                      "cache_salt": "t", "max_tokens": 5, "temperature": 0.3}).encode()  # fmt: skip
    fast = _token_ids_body(raw)
    assert fast is not None
    general, _ = _completion_tokens(decode_body(raw), None)
    assert general is not None and fast[1].tolist() == general.tolist()
    req = parse_request("completions", raw, None)
    assert (req.model, req.stream, req.cache_salt, req.max_tokens) == ("m", True, "t", 5)
    assert _token_ids_body(b'{"model": "m", "prompt": "text"}') is None


@pytest.mark.parametrize(
    ("kind", "body", "limit"),
    [  # vLLM: a completion has no max_completion_tokens; a chat's wins unless it is null
        ("completions", {"prompt": [1, 2], "max_tokens": 3, "max_completion_tokens": 200_000}, 3),
        ("completions", {"prompt": "hi", "max_tokens": 3, "max_completion_tokens": "x"}, 3),
        ("completions", {"prompt": [1, 2], "max_completion_tokens": 7}, None),
        ("chat", {"max_tokens": 3, "max_completion_tokens": 9}, 9),
        ("chat", {"max_tokens": 3, "max_completion_tokens": None}, 3),
        ("chat", {"max_completion_tokens": 0}, 0),
    ],
)
def test_max_tokens_are_read_as_vllm_reads_them(
    kind: str, body: dict[str, Any], limit: int | None
) -> None:
    """The router's context check takes the output limit vLLM takes (``max_completion_tokens``
    is a chat field only; vLLM's ``CompletionRequest`` ignores it): a request every engine
    accepts is never refused by the router."""
    if kind == "chat":
        body = {"messages": MESSAGES, **body}
    req = parse_request(kind, json.dumps({"model": "m", **body}).encode(), None)  # type: ignore[arg-type]
    assert req.max_tokens == limit


def test_a_long_text_is_encoded_with_the_gil_released(directory: Path) -> None:
    """The router's event loop runs beside a long prompt's encoding (``tokenizers``' ``encode``
    holds the GIL throughout; its batch encoder releases it): every other client, and the
    engines' health probes, waited seconds behind a few megabytes of text."""
    import threading
    import time

    ours = PromptTokenizer(directory)
    text = " ".join(f"w{i}x{i * 7}" for i in range(60_000))
    short = "the quick brown fox"
    assert ours.encode_text(text) == load_hf_tokenizer(directory)(text)["input_ids"]
    assert (
        ours.encode_text(short, add_special_tokens=False)
        == load_hf_tokenizer(directory)(short, add_special_tokens=False)["input_ids"]
    )
    ran, started, done = [0], threading.Event(), threading.Event()

    def beside() -> None:  # what the event loop's thread does meanwhile: short steps
        started.wait()
        while not done.is_set():
            ran[0] += 1
            time.sleep(0.0005)

    def encode() -> None:
        started.set()
        ours.encode_text(text)
        done.set()

    threads = [threading.Thread(target=beside), threading.Thread(target=encode)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # holding the GIL, the encoder lets the other thread in at most once or twice (its own
    # start, the list of ids made at its end); released, the other thread steps throughout
    assert ran[0] >= 20, f"the other thread stepped {ran[0]} times during the encoding"
