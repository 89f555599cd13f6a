"""Workloads for fleet benchmarks (docs/workloads.md): Mooncake-format traces with token ids
made from their hash ids, and the ``rag:`` generator of documents reused at varying offsets.
Deterministic: the same source and seed give the same requests, token for token."""

from kvatlas.workloads.mooncake import TraceRequest, mooncake_prompt, read_mooncake
from kvatlas.workloads.rag import RagSpec, generate_rag, parse_rag
from kvatlas.workloads.source import open_workload
from kvatlas.workloads.tokens import BLOCK_SPAN, VOCAB_SIZE, block_tokens

__all__ = [
    "BLOCK_SPAN",
    "VOCAB_SIZE",
    "RagSpec",
    "TraceRequest",
    "block_tokens",
    "generate_rag",
    "mooncake_prompt",
    "open_workload",
    "parse_rag",
    "read_mooncake",
]
