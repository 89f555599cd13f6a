"""The engine's tokenization, reproduced: text and chat become the token ids the engine will
compute, or the keys the router scores would never match what the engine caches.

What vLLM does, and so what this does (docs/router.md, "Tokens"):

* completions text: ``tokenizer(prompt, add_special_tokens=body.add_special_tokens)``
  (default true: the tokenizer's post-processor adds BOS where the model wants one);
* chat: Hugging Face ``apply_chat_template`` semantics
  (:class:`~kvatlas.chat_template.ChatTemplate`, the simulated engine's renderer too),
  ``add_generation_prompt`` default true; then the text encoded with ``add_special_tokens``
  false (the template writes BOS itself), as vLLM's chat endpoint does.

A template that raises is the caller's error (400), as on the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvatlas.chat_template import ChatTemplate
from kvatlas.errors import InvalidInput

SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def _token_text(value: Any) -> str | None:
    """A ``tokenizer_config.json`` special token: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_from_config(config: Mapping[str, Any]) -> str | None:
    """``chat_template`` of a tokenizer config: a string, or named templates (``default``)."""
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        found = named.get("default")
        return found if isinstance(found, str) else None
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return doc


_ENCODE_RELEASING_CHARS = 16_384
"""Texts from this long are encoded with the GIL released (the batch encoder's thread pool
costs more than a short text's encoding)."""


class PromptTokenizer:
    """``encode_text`` (completions) and ``encode_chat`` (chat) as the engine computes them."""

    def __init__(self, tokenizer: Path, chat_template: Path | None = None) -> None:
        directory = tokenizer if tokenizer.is_dir() else tokenizer.parent
        tokenizer_file = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers package raises its own exception types
            raise ValueError(f"--tokenizer: cannot load {tokenizer_file}: {exc}") from None
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        self.special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))
        }
        source = self._template_source(chat_template, config, directory)
        self.chat_template_source = source
        self._chat = ChatTemplate(source, self.special_tokens) if source is not None else None

    @staticmethod
    def _template_source(
        chat_template: Path | None, config: Mapping[str, Any], directory: Path
    ) -> str | None:
        if chat_template is not None:
            if chat_template.suffix == ".json":
                found = _template_from_config(_read_json(chat_template))
                if found is None:
                    raise ValueError(f"--chat-template: {chat_template} has no chat_template")
                return found
            try:
                return chat_template.read_text()
            except OSError as exc:
                raise ValueError(f"--chat-template: {exc}") from None
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        return _template_from_config(config)

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; a long one by the batch encoder, which releases the GIL
        (``encode`` holds it throughout: a few megabytes of text stopped the router's event
        loop for seconds, every other client and the engines' health probes with it)."""
        if len(text) < _ENCODE_RELEASING_CHARS:
            ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
            return ids
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids  # type: ignore[no-any-return]

    def render_chat(self, messages: list[dict[str, Any]], **render: Any) -> str:
        """The chat as the template writes it (:meth:`ChatTemplate.render`'s options)."""
        if self._chat is None:
            raise InvalidInput("this router has no chat template for the model (--chat-template)")
        return self._chat.render(messages, **render)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_special_tokens: bool = False,
        **render: Any,
    ) -> list[int]:
        return self.encode_text(
            self.render_chat(messages, **render), add_special_tokens=add_special_tokens
        )
