"""Which rotary style a model type's attention uses: shared by the node (``--hf-config``) and
the vLLM connector (blend's RoPE check), so both read a ``model_type`` the same way.

RoPE rotates pairs of a head's dims: ``neox`` pairs ``(j, j + r/2)`` (rotate-half), ``gptj``
pairs ``(2j, 2j + 1)`` (interleaved). No config field says which: the model's code decides. A
``model_type`` not listed is not guessed (:func:`rope_style_of` gives ``None``): the wrong style
re-RoPEs every reused K wrongly, and nothing fails.
"""

from __future__ import annotations

from typing import Final

ROTATE_HALF_MODELS: Final = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
     "gemma2", "phi3", "granite", "olmo", "olmo2", "starcoder2", "stablelm", "gpt_neox"}
)  # fmt: skip
"""``model_type``s whose transformers implementation rotates halves (``neox``), as vLLM 0.33's
does for those it implements (``is_neox_style`` left ``True``)."""
INTERLEAVED_MODELS: Final = frozenset({"gptj", "codegen", "cohere"})
"""``model_type``s whose implementations rotate adjacent pairs (``gptj``; vLLM's ``gpt_j.py``,
``commandr.py``: ``is_neox_style=False``)."""


def rope_style_of(model_type: str) -> str | None:
    """The rotary style of a ``model_type``'s attention; ``None``: not one listed here."""
    if model_type in ROTATE_HALF_MODELS:
        return "neox"
    return "gptj" if model_type in INTERLEAVED_MODELS else None
