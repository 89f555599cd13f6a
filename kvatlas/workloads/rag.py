"""The ``rag:`` workload: documents reused at varying offsets, which no public trace has.

``rag:docs=D,k=K,zipf=S,rate=R,seed=N`` (optional: ``system=``, ``question=``, ``output=``,
``doc_min=``, ``doc_max=``). A corpus of ``D`` documents whose lengths are log-uniform in
``[doc_min, doc_max]`` tokens; every request is one shared system prompt, then ``K`` distinct
documents drawn by Zipf popularity (document of rank ``r`` with weight ``r^-S``) in an order
drawn per request, then a question of its own; arrivals are Poisson at ``R`` requests per
second. The same spec is the same trace (prompts, order, arrivals); another seed is another
corpus and another trace. Token ids come from :mod:`kvatlas.workloads.tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np

from kvatlas.errors import InvalidInput
from kvatlas.workloads.mooncake import TraceRequest
from kvatlas.workloads.tokens import (
    BLOCK_SPAN,
    RAG_DOCS,
    RAG_QUESTIONS,
    RAG_SYSTEM,
    block_tokens,
    span_tokens,
)

PREFIX = "rag:"


@dataclass(frozen=True, slots=True)
class RagSpec:
    docs: int = 1000
    k: int = 4
    zipf: float = 1.0
    rate: float = 4.0
    seed: int = 0
    system: int = 512
    question: int = 64
    output: int = 128
    doc_min: int = 256
    doc_max: int = 2048

    def __post_init__(self) -> None:
        if self.docs < 1 or not 1 <= self.k <= self.docs:
            raise InvalidInput("rag: needs docs ≥ 1 and 1 ≤ k ≤ docs")
        if self.zipf < 0 or not self.rate > 0:
            raise InvalidInput("rag: zipf must be ≥ 0 and rate > 0")
        if not 0 <= self.seed < 1 << 20:
            raise InvalidInput("rag: seed must be in [0, 2**20)")
        if not 0 <= self.system <= 8 * BLOCK_SPAN or not 1 <= self.question <= BLOCK_SPAN:
            raise InvalidInput(
                f"rag: system in [0, {8 * BLOCK_SPAN}], question in [1, {BLOCK_SPAN}]"
            )
        if not 1 <= self.doc_min <= self.doc_max <= 8 * BLOCK_SPAN or self.output < 1:
            raise InvalidInput(f"rag: 1 ≤ doc_min ≤ doc_max ≤ {8 * BLOCK_SPAN}, output ≥ 1")

    def namespace(self, kind: int) -> int:
        return kind + 8 * self.seed


def parse_rag(text: str) -> RagSpec:
    """``rag:key=value,...``; unknown keys and malformed values are refused."""
    if not text.startswith(PREFIX):
        raise InvalidInput(f"a rag workload starts with {PREFIX!r}: {text!r}")
    types = {f.name: f.type for f in fields(RagSpec)}
    values: dict[str, int | float] = {}
    body = text[len(PREFIX) :]
    for item in filter(None, body.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or key not in types:
            raise InvalidInput(
                f"rag: unknown or malformed item {item!r} (keys: {', '.join(types)})"
            )
        if key in values:
            raise InvalidInput(f"rag: {key} given twice")
        try:
            values[key] = float(raw) if types[key] in (float, "float") else int(raw)
        except ValueError:
            raise InvalidInput(f"rag: {key}={raw!r} is not a number of the right kind") from None
    return RagSpec(**values)  # type: ignore[arg-type]


def document_lengths(spec: RagSpec) -> np.ndarray:
    rng = np.random.default_rng([spec.seed, 1])
    lo, hi = np.log(spec.doc_min), np.log(spec.doc_max)
    return (
        np.exp(rng.uniform(lo, hi, spec.docs))
        .round()
        .astype(np.int64)
        .clip(spec.doc_min, spec.doc_max)
    )


def generate_rag(spec: RagSpec, requests: int) -> Iterator[TraceRequest]:
    lengths = document_lengths(spec)
    weights = np.arange(1, spec.docs + 1, dtype=np.float64) ** -spec.zipf
    weights /= weights.sum()
    rng = np.random.default_rng([spec.seed, 2])
    system = span_tokens(spec.namespace(RAG_SYSTEM), 0, spec.system)
    docs: dict[int, np.ndarray] = {}
    t = 0.0
    for i in range(requests):
        t += rng.exponential(1.0 / spec.rate)
        chosen = rng.choice(spec.docs, size=spec.k, replace=False, p=weights)
        rng.shuffle(chosen)
        parts = [system]
        segments = [("rag:system", 0, spec.system)] if spec.system else []
        offset = spec.system
        for d in chosen.tolist():
            if d not in docs:
                docs[d] = span_tokens(spec.namespace(RAG_DOCS), d * 8, int(lengths[d]))
            parts.append(docs[d])
            segments.append((f"rag:doc:{d}", offset, int(lengths[d])))
            offset += int(lengths[d])
        parts.append(block_tokens(spec.namespace(RAG_QUESTIONS), i, spec.question))
        segments.append((f"rag:question:{i}", offset, spec.question))
        yield TraceRequest(i, t, np.concatenate(parts), spec.output, tuple(segments))
