"""Workloads for fleet benchmarks (docs/workloads.md): Mooncake-format traces with token ids
made from their hash ids, and the ``rag:`` generator of documents reused at varying offsets.
Deterministic: the same source and seed give the same requests, token for token."""

from kvatlas.workloads.mooncake import TraceRequest, mooncake_prompt, read_mooncake
from kvatlas.workloads.rag import RagSpec, generate_rag, parse_rag
from kvatlas.workloads.source import open_workload
from kvatlas.workloads.tokens import (
    BLOCK_SPAN,
    LLAMA2,
    LLAMA3,
    VOCAB_SIZE,
    Vocabulary,
    block_tokens,
    random_token_ids,
)

__all__ = [
    "BLOCK_SPAN",
    "LLAMA2",
    "LLAMA3",
    "VOCAB_SIZE",
    "RagSpec",
    "TraceRequest",
    "Vocabulary",
    "block_tokens",
    "generate_rag",
    "mooncake_prompt",
    "open_workload",
    "parse_rag",
    "random_token_ids",
    "read_mooncake",
]
