"""Text to token ids, as the engine's own tokenizer would do it.

With ``--tokenizer tokenizer.json`` a Hugging Face tokenizer (the ``tokenizers`` package, the
``tokenizer`` extra) encodes text exactly as the served model's does: completions with the
model's special tokens (vLLM's ``add_special_tokens`` default), chat prompts without them (the
template writes them). Without one, a documented deterministic fallback: one token per UTF-8
byte (id = the byte's value), which any other program can reproduce. Chat messages become one
prompt through a ChatML template (``<|im_start|>{role}\n{content}<|im_end|>\n`` per message,
then ``<|im_start|>assistant\n``). Output tokens are drawn from :attr:`output_vocab` (with the
fallback: lower-case letters and the space, so output text is readable ASCII).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHATML_START = "<|im_start|>"
CHATML_END = "<|im_end|>"


def render_chatml(messages: Sequence[tuple[str, str]]) -> str:
    parts = [f"{CHATML_START}{role}\n{content}{CHATML_END}\n" for role, content in messages]
    return "".join(parts) + f"{CHATML_START}assistant\n"


class Tokenizer:
    """Byte-level fallback; :meth:`from_file` loads a Hugging Face ``tokenizer.json``."""

    def __init__(self, hf: Any = None) -> None:
        self._hf = hf
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

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode(render_chatml(messages), add_special_tokens=False)
