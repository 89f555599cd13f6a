"""Deterministic synthetic token ids: the same (namespace, id) always gives the same tokens.

Token ``i`` of block ``b`` in ``namespace`` is ``splitmix64(namespace · 2^40 + b · 2^9 + i)``
mod the vocabulary (128,256, Llama 3's, so ids do not fit 16 bits): any program can rebuild a
trace's prompts from this rule alone. SplitMix64 is Vigna's 64-bit finalizer (public domain),
vectorised with numpy's wrapping uint64 arithmetic.

Benchmarks that need random ids rather than a trace's draw them here too
(:func:`random_token_ids`), from a named :class:`Vocabulary`: :data:`LLAMA3` by default (the
real case), :data:`LLAMA2` for the kinder case of ids that fit 16 bits (a second row, labelled
as such).
"""

from __future__ import annotations

from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

VOCAB_SIZE: Final = 128_256
BLOCK_SPAN: Final = 512  # positions per block id (Mooncake's 512 tokens per hash id)
MOONCAKE: Final = 1
RAG_DOCS: Final = 2
RAG_SYSTEM: Final = 3
RAG_QUESTIONS: Final = 4


class Vocabulary(NamedTuple):
    """A served model's vocabulary: token ids are in ``[0, size)``."""

    name: str
    size: int

    @property
    def label(self) -> str:
        """How a benchmark row names it."""
        fits = ", fit 16 bits" if self.size <= 1 << 16 else ""
        return f"{self.name} vocabulary, {self.size:,} ids{fits}"


LLAMA3: Final = Vocabulary("Llama 3", VOCAB_SIZE)
"""The default: ids do not fit 16 bits (Qwen 2.5's 151,646 and Gemma's 256,000 neither)."""
LLAMA2: Final = Vocabulary("Llama 2", 32_000)
"""The kinder case, a second row: every id fits 16 bits."""


def random_token_ids(
    rng: np.random.Generator, shape: int | tuple[int, ...], vocab: Vocabulary = LLAMA3
) -> npt.NDArray[np.uint32]:
    """Token ids drawn uniformly from ``vocab`` as ``uint32`` (the wire's width)."""
    return rng.integers(0, vocab.size, shape, dtype=np.uint32)


_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _M1
        z = (z ^ (z >> np.uint64(30))) * _M2
        z = (z ^ (z >> np.uint64(27))) * _M3
        return z ^ (z >> np.uint64(31))


def block_tokens(namespace: int, block_id: int, length: int = BLOCK_SPAN,
                 vocab_size: int = VOCAB_SIZE) -> np.ndarray:  # fmt: skip
    """The first ``length`` (≤ 512) tokens of block ``block_id`` of ``namespace``, as int64."""
    if not 0 <= length <= BLOCK_SPAN:
        raise ValueError(f"a block has at most {BLOCK_SPAN} tokens, asked {length}")
    if block_id < 0 or block_id >= 1 << 31:
        raise ValueError(f"block ids are in [0, 2**31), got {block_id}")
    base = (namespace << 40) + (block_id << 9)
    keys = np.arange(base, base + length, dtype=np.uint64)
    return (splitmix64(keys) % np.uint64(vocab_size)).astype(np.int64)


def span_tokens(namespace: int, first_block: int, length: int) -> np.ndarray:
    """``length`` tokens made of consecutive blocks from ``first_block`` on."""
    parts = []
    block = first_block
    while length > 0:
        n = min(length, BLOCK_SPAN)
        parts.append(block_tokens(namespace, block, n))
        length -= n
        block += 1
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
