"""Text to token ids, as the engine's own tokenizer would do it.

With ``--tokenizer tokenizer.json`` a Hugging Face tokenizer (the ``tokenizers`` package, the
``tokenizer`` extra) encodes text exactly as the served model's does, with the model's special
tokens as the request's ``add_special_tokens`` says (vLLM's defaults: true for completions,
false for chat, whose template writes them). Without one, a documented deterministic fallback:
one token per UTF-8 byte (id = the byte's value), which any other program can reproduce. Chat
messages become one prompt through the ChatML template :data:`CHATML_TEMPLATE`
(``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then ``<|im_start|>assistant\n``
with ``add_generation_prompt``), rendered as vLLM renders a model's template
(:class:`~kvatlas.chat_template.ChatTemplate`, the router's renderer too). Output tokens are
drawn from :attr:`output_vocab` (with the fallback: lower-case letters and the space, so output
text is readable ASCII).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvatlas.chat_template import ChatTemplate

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Tokenizer:
    """Byte-level fallback; :meth:`from_file` loads a Hugging Face ``tokenizer.json``."""

    def __init__(self, hf: Any = None) -> None:
        self._hf = hf
        self.chat_template = ChatTemplate(CHATML_TEMPLATE)
        if hf is None:
            self.output_vocab: Sequence[int] = [*range(ord("a"), ord("z") + 1), ord(" ")]
        else:
            self.output_vocab = range(hf.get_vocab_size())

    @classmethod
    def from_file(cls, path: Path | None) -> Tokenizer:
        if path is None:
            return cls()
        try:
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError as exc:
            raise ValueError(
                "--tokenizer needs the 'tokenizers' package (a dependency of kvatlas: reinstall it)"
            ) from exc
        try:
            return cls(HfTokenizer.from_file(str(path)))
        except Exception as exc:  # the library raises its own exception types
            raise ValueError(f"--tokenizer {path}: {exc}") from exc

    @property
    def name(self) -> str:
        return "bytes" if self._hf is None else "tokenizer.json"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf is None:
            return list(text.encode("utf-8"))
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self._hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return str(self._hf.decode(list(ids), skip_special_tokens=True))

    def chat_prompt(
        self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False, **render: Any
    ) -> list[int]:
        """``messages`` rendered (:meth:`ChatTemplate.render`'s options), then encoded."""
        text = self.chat_template.render(messages, **render)
        return self.encode(text, add_special_tokens=add_special_tokens)
