"""``kvatlas engine-sim`` flags: one dataclass, every field a flag (also ``KVATLAS_<NAME>``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvatlas.checks import check_http_url, check_port
from kvatlas.config_flags import add_dataclass_arguments, check_choices, dataclass_from_args
from kvatlas.engine_sim.cost_model import CostModel
from kvatlas.logs import LOG_FORMATS, LOG_LEVELS

_COST = CostModel()

RENAMED_FLAGS = {
    "gpu_hbm_bytes_s": "gpu_hbm_bytes_per_s",
    "cpu_link_bytes_s": "cpu_link_bytes_per_s",
    "node_l1_bytes_s": "l1_bandwidth_bytes_per_s",
    "node_l2_bytes_s": "l2_bandwidth_bytes_per_s",
    "node_peer_bytes_s": "peer_bandwidth_bytes_per_s",
}
"""Old field (flag, variable) names and their new ones, the router's for the same rates: the
old ones work, with a warning, for one release (:mod:`kvatlas.config_flags`)."""


@dataclass(frozen=True, slots=True)
class EngineSimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    instance_id: str = "engine-sim"
    tokenizer: Path | None = None
    block_size: int = 16
    gpu_blocks: int = 8192
    cpu_blocks: int = 0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 131_072
    natural_output_tokens: int = 128
    speed: float = 1.0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str | None = None
    kv_events_buffer_steps: int = 10_000
    model_params: float = _COST.params
    model_layers: int = _COST.layers
    model_hidden: int = _COST.hidden
    kv_bytes_per_token: int = _COST.kv_bytes_per_token
    gpu_peak_flops: float = _COST.peak_flops
    gpu_mfu: float = _COST.mfu
    gpu_hbm_bytes_per_s: float = _COST.hbm_bytes_per_s
    gpu_hbm_efficiency: float = _COST.hbm_efficiency
    step_overhead_s: float = _COST.step_overhead_s
    cpu_link_bytes_per_s: float = _COST.cpu_link_bytes_per_s
    node_url: str | None = None
    node_token_file: Path | None = None
    node_timeout_s: float = 10.0
    recompute_share: float = 0.15
    l1_bandwidth_bytes_per_s: float = 25e9
    l2_bandwidth_bytes_per_s: float = 7e9
    peer_bandwidth_bytes_per_s: float = 12.5e9
    max_body_bytes: int = 64 << 20
    log_level: str = "info"
    log_format: str = "json"

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs",
                    "max_model_len", "natural_output_tokens", "kv_events_buffer_steps",
                    "model_layers", "model_hidden", "kv_bytes_per_token", "max_body_bytes")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        check_port("--port", self.port)
        if self.gpu_blocks < 2:
            raise ValueError("--gpu-blocks must be at least 2 (block 0 is vLLM's null block)")
        if self.cpu_blocks < 0:
            raise ValueError("--cpu-blocks must be 0 (no offload) or more")
        rates = ("speed", "model_params", "gpu_peak_flops", "gpu_mfu", "gpu_hbm_bytes_per_s",
                 "gpu_hbm_efficiency", "cpu_link_bytes_per_s", "node_timeout_s", "l1_bandwidth_bytes_per_s",
                 "l2_bandwidth_bytes_per_s", "peer_bandwidth_bytes_per_s")  # fmt: skip
        for name in rates:
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0")
        if not 0 <= self.step_overhead_s < math.inf:  # NaN: every request hung
            raise ValueError("--step-overhead-s must be a finite number >= 0")
        if "@" in self.instance_id or not self.instance_id:
            raise ValueError("--instance-id must be non-empty and have no '@' (topic separator)")
        if not 0.0 <= self.recompute_share <= 1.0:
            raise ValueError("--recompute-share must be in [0, 1]")
        if self.node_url:
            check_http_url(self.node_url, "--node-url")
        if self.node_token_file is not None and not self.node_url:
            raise ValueError("--node-token-file needs --node-url")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        check_choices(self, _CHOICES)  # the rest (a variable's: argparse checks a flag's only)

    @property
    def topic(self) -> str:
        return self.kv_events_topic or f"kv@{self.instance_id}@{self.model}"

    def cost_model(self) -> CostModel:
        return CostModel(
            params=self.model_params, layers=self.model_layers, hidden=self.model_hidden,
            kv_bytes_per_token=self.kv_bytes_per_token, peak_flops=self.gpu_peak_flops,
            mfu=self.gpu_mfu, hbm_bytes_per_s=self.gpu_hbm_bytes_per_s,
            hbm_efficiency=self.gpu_hbm_efficiency, step_overhead_s=self.step_overhead_s,
            cpu_link_bytes_per_s=self.cpu_link_bytes_per_s,
        )  # fmt: skip


_HELP: Mapping[str, str] = {
    "host": "address to serve the OpenAI API on",
    "port": "port of the OpenAI API",
    "model": "the served model name (/v1/models; requests naming another model get 404)",
    "instance_id": "the engine id the directory knows it by (the KV-events topic's emitter)",
    "tokenizer": "a Hugging Face tokenizer.json for text prompts (needs the 'tokenizers' "
    "package); unset: one token per UTF-8 byte (docs/engine-sim.md)",
    "block_size": "tokens per KV block (vLLM's --block-size)",
    "gpu_blocks": "KV blocks on the GPU, block 0 included (vLLM's num_gpu_blocks)",
    "cpu_blocks": "KV blocks of the CPU offload tier (medium CPU); 0: no offload",
    "max_num_batched_tokens": "token budget of one step (vLLM's --max-num-batched-tokens)",
    "max_num_seqs": "requests running at once (vLLM's --max-num-seqs)",
    "max_model_len": "prompt + output tokens of one request (vLLM's --max-model-len)",
    "natural_output_tokens": "output tokens of a request without max_tokens (finish_reason "
    "stop): stands in for the end-of-sequence a real model samples",
    "speed": "model seconds per wall second (100: a trace hour in 36 s)",
    "kv_events_endpoint": "ZMQ PUB endpoint of the KV events (tcp://*:5557 binds, "
    "tcp://host:5557 connects, as vLLM); unset: no events",
    "kv_events_replay_endpoint": "ZMQ ROUTER endpoint replaying past batches (always binds)",
    "kv_events_topic": "topic of the KV events; unset: kv@<instance-id>@<model>",
    "kv_events_buffer_steps": "batches kept for replay (vLLM's buffer_steps)",
    "model_params": "cost model: parameters of the simulated model",
    "model_layers": "cost model: transformer layers",
    "model_hidden": "cost model: hidden size",
    "kv_bytes_per_token": "cost model: KV bytes per token (all layers, K and V)",
    "gpu_peak_flops": "cost model: the GPU's dense bf16 FLOP/s",
    "gpu_mfu": "cost model: achieved share of peak FLOP/s",
    "gpu_hbm_bytes_per_s": "cost model: HBM bytes/s",
    "gpu_hbm_efficiency": "cost model: achieved share of HBM bandwidth",
    "step_overhead_s": "cost model: fixed seconds per step",
    "cpu_link_bytes_per_s": "cost model: CPU offload → GPU bytes/s",
    "node_url": "the kvatlas connector: a kvatlas node's engine API URL; prefixes and "
    "fragments are reused through it and computed chunks (zeros) stored there; the node's "
    "--model-name must be --model (another model's node is refused); unset: vLLM alone",
    "node_token_file": "a file holding the engine bearer token for --node-url",
    "node_timeout_s": "seconds per node call (a failed call is a miss)",
    "recompute_share": "share of a reused fragment's tokens still computed (CacheBlend's "
    "selective recompute, ~15%%)",
    "l1_bandwidth_bytes_per_s": "cost model: node L1 (host DRAM) → GPU bytes/s",
    "l2_bandwidth_bytes_per_s": "cost model: node L2 (local NVMe or Redis) → GPU bytes/s",
    "peer_bandwidth_bytes_per_s": "cost model: a peer node's L1/L2 → GPU bytes/s (the network)",
    "max_body_bytes": "largest request body accepted (413 beyond)",
    "log_level": "log level",
    "log_format": "log format: json lines or text",
}
_CHOICES = {"log_level": LOG_LEVELS, "log_format": LOG_FORMATS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, EngineSimConfig, _HELP, _CHOICES, renamed=RENAMED_FLAGS)


def config_from_args(args: argparse.Namespace) -> EngineSimConfig:
    return dataclass_from_args(EngineSimConfig, args, renamed=RENAMED_FLAGS)
