"""How long one engine step takes, from a roofline of a named model on a named GPU.

A step of continuous batching runs every scheduled token through the model once: prefill
chunks (many tokens of one request) and decode tokens (one per running request). Its time is
the larger of the compute time (weight FLOPs per token plus attention FLOPs over the context)
and the memory time (all weights once, plus every decode sequence's KV read once), plus a fixed
per-step overhead (scheduling, sampling, launch). Reused tokens cost no compute; a block loaded
from the CPU tier costs its bytes over the host link before its request can run.

Defaults: Llama-3.1-8B (8.03 B parameters, 32 layers, 8 KV heads × 128 dims, bf16: 128 KiB of
KV per token; its Hugging Face ``config.json``) on one NVIDIA H100 SXM (989 TFLOPS dense bf16,
3.35 TB/s HBM3; NVIDIA's datasheet), at the efficiencies named below. docs/engine-sim.md gives
the sources and the resulting rates; each constant is a flag of ``kvatlas engine-sim``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    params: float = 8.03e9
    layers: int = 32
    hidden: int = 4096
    kv_bytes_per_token: int = 131_072  # 2 (K,V) × 32 layers × 8 heads × 128 dims × 2 bytes
    peak_flops: float = 989e12  # H100 SXM, dense bf16
    mfu: float = 0.4  # achieved share of peak in prefill (large GEMMs)
    hbm_bytes_per_s: float = 3.35e12  # H100 SXM HBM3
    hbm_efficiency: float = 0.7  # achieved share of HBM bandwidth in decode
    step_overhead_s: float = 0.002  # scheduler, sampling, kernel launches per step
    cpu_link_bytes_per_s: float = 25e9  # CPU offload → GPU (PCIe Gen5 x16, ~40% of 64 GB/s)
    weight_bytes_per_param: float = 2.0  # bf16

    def step_seconds(self, prefill_tokens: int, prefill_context: int, decode_seqs: int,
                     decode_context: int) -> float:  # fmt: skip
        """``prefill_tokens`` computed this step, ``prefill_context`` the sum over them of the
        tokens each attends to; ``decode_seqs`` decode tokens, ``decode_context`` the sum of
        their sequences' lengths. Zero work is zero time."""
        tokens = prefill_tokens + decode_seqs
        if tokens == 0:
            return 0.0
        attn_ctx = prefill_context + decode_context
        flops = 2 * self.params * tokens + 4 * self.layers * self.hidden * attn_ctx
        compute = flops / (self.peak_flops * self.mfu)
        weights = self.params * self.weight_bytes_per_param
        memory = (weights + decode_context * self.kv_bytes_per_token) / (
            self.hbm_bytes_per_s * self.hbm_efficiency
        )
        return max(compute, memory) + self.step_overhead_s

    def cpu_load_seconds(self, tokens: int) -> float:
        """Loading ``tokens`` of KV from the CPU tier into GPU blocks."""
        return tokens * self.kv_bytes_per_token / self.cpu_link_bytes_per_s

    def prefill_tokens_per_s(self) -> float:
        """The compute-bound prefill rate without attention (for the docs and sanity checks)."""
        return self.peak_flops * self.mfu / (2 * self.params)
