"""Mooncake-format traces (kvcache-ai/Mooncake's FAST'25 release): one JSON object per line,
``timestamp`` (arrival, ms from the start), ``input_length``, ``output_length`` and
``hash_ids`` (one per 512 prompt tokens; equal ids at equal positions are a shared prefix).

A replay makes the prompt from the hash ids: id ``h`` → the 512 tokens of block ``h``
(:func:`~kvatlas.workloads.tokens.block_tokens`, namespace ``MOONCAKE``), the last block cut
to ``input_length``, so equal prefixes stay equal and different ones differ. A line that
breaks the format (missing or negative fields, fewer hash ids than the input needs, more than
it can hold, arrivals going back) is refused with its line number, never guessed around.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvatlas.checks import is_plain_int
from kvatlas.errors import InvalidInput
from kvatlas.workloads.tokens import BLOCK_SPAN, MOONCAKE, block_tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload: when it arrives, its prompt, how many tokens it generates.
    ``segments`` names where the prompt's pieces come from (``(source, offset, length)``:
    ``mooncake:<hash id>``, ``rag:system``, ``rag:doc:<id>``, ``rag:question:<i>``), so a
    benchmark can tell prefix reuse from fragment reuse without re-deriving it."""

    index: int
    arrival_s: float
    prompt: np.ndarray  # int64 token ids
    output_tokens: int
    segments: tuple[tuple[str, int, int], ...] = ()

    @property
    def input_tokens(self) -> int:
        return int(self.prompt.shape[0])


def _field(entry: dict[str, object], name: str, where: str) -> int:
    value = entry.get(name)
    if not is_plain_int(value) or value < 0:
        raise InvalidInput(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def mooncake_prompt(hash_ids: list[int], input_length: int) -> np.ndarray:
    parts = []
    left = input_length
    for h in hash_ids:
        n = min(left, BLOCK_SPAN)
        parts.append(block_tokens(MOONCAKE, h, n))
        left -= n
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def read_mooncake(path: Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """The trace's requests in file order (arrival order), at most ``limit``."""
    last_ms = 0.0
    with open(path, encoding="utf-8") as lines:
        index = 0
        for number, line in enumerate(lines, start=1):
            if limit is not None and index >= limit:
                return
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"{where}: not JSON ({exc})") from None
            if not isinstance(entry, dict):
                raise InvalidInput(f"{where}: not a JSON object")
            ts = entry.get("timestamp")
            if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < last_ms:
                raise InvalidInput(f"{where}: timestamp must be a number ≥ the previous one")
            inputs = _field(entry, "input_length", where)
            outputs = _field(entry, "output_length", where)
            hash_ids = entry.get("hash_ids")
            if not isinstance(hash_ids, list) or not all(
                is_plain_int(h) and 0 <= h < 1 << 31 for h in hash_ids
            ):
                raise InvalidInput(f"{where}: hash_ids must be a list of ids in [0, 2**31)")
            blocks = -(-inputs // BLOCK_SPAN)
            if len(hash_ids) != blocks:
                raise InvalidInput(f"{where}: {inputs} input tokens need {blocks} hash ids "
                                   f"of {BLOCK_SPAN} tokens, the line has {len(hash_ids)}")  # fmt: skip
            last_ms = float(ts)
            segments = tuple(
                (f"mooncake:{h}", i * BLOCK_SPAN, min(BLOCK_SPAN, inputs - i * BLOCK_SPAN))
                for i, h in enumerate(hash_ids)
            )
            yield TraceRequest(index, float(ts) / 1000.0, mooncake_prompt(hash_ids, inputs),
                               outputs, segments)  # fmt: skip
            index += 1
