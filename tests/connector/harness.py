"""Drives :class:`KvatlasConnector` the way vLLM 0.33 does, with vLLM's own classes.

Scheduler side, per new request (``vllm/v1/core/sched/scheduler.py``, ``schedule()``):
``get_num_new_matched_tokens(request, block_aligned_local_hit)`` → blocks allocated →
``update_state_after_alloc(request, KVCacheBlocks, num_external_tokens)`` → per step
``build_connector_meta(SchedulerOutput)`` → at the end ``request_finished(request, block_ids)``.
Worker side, per step (``vllm/v1/worker/kv_connector_model_runner_mixin.py`` and the attention
hook ``maybe_transfer_kv_layer``): ``bind_connector_metadata`` → ``start_load_kv`` (before the
forward when the step has sync loads) → per attention layer ``wait_for_layer_load``, the layer
writes its new KV, ``save_kv_layer`` → ``wait_for_save`` → ``get_transfer_results`` →
``get_block_ids_with_load_errors`` → ``clear_connector_metadata``.

The "model" is the toy RoPE model (``kvatlas.node.toy_model``): every layer's K/V depends only
on the token and its position, so the exact KV of any token at any position is known.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.transformers_utils.config import get_config, get_hf_text_config
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvatlas.connector import KvatlasConnector
from kvatlas.connector.pages import kv_planes
from kvatlas.connector.settings import BACKEND_PACKINGS
from kvatlas.node import KVLayout
from kvatlas.node.toy_model import ToyRopeModel
from tests.conftest import wait_for

BLOCK = 8
NUM_BLOCKS = 64


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def llama_config(layout: KVLayout, **changes: object) -> dict[str, object]:
    """A Llama ``config.json`` of ``layout``'s shapes and RoPE (the model ``vllm serve``
    reads), with ``changes``."""
    assert layout.rope_style == "neox", "a Llama rotates halves"
    heads, dim = layout.num_kv_heads, layout.head_dim
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": dim,
        "hidden_size": heads * dim, "num_attention_heads": heads, "num_key_value_heads": heads,
        "num_hidden_layers": layout.num_layers, "rope_theta": layout.rope_theta,
        "torch_dtype": layout.dtype, "vocab_size": 512,
    }  # fmt: skip
    if layout.rope_dim != dim:
        config["partial_rotary_factor"] = layout.rope_dim / dim
    return {**config, **changes}


def hf_configs(config: Mapping[str, object]) -> tuple[Any, Any]:
    """vLLM's ``ModelConfig.hf_config`` and ``hf_text_config`` of a ``config.json``: read by
    vLLM's own ``get_config`` (transformers' config class, vLLM's RoPE patches), as
    ``vllm serve`` reads the model's."""
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        hf_config = get_config(model_dir, trust_remote_code=False)
    return hf_config, get_hf_text_config(hf_config)


def make_request(
    rid: str, tokens: Sequence[int], *, salt: str | None = None,
    images: Sequence[tuple[str, int, int]] = (), lora: LoRARequest | None = None,
) -> Request:  # fmt: skip
    mm = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                              mm_position=PlaceholderRange(offset=offset, length=length))
        for ident, offset, length in images
    ]  # fmt: skip
    return Request(
        rid, [int(t) for t in tokens], SamplingParams(max_tokens=1), None,
        cache_salt=salt, mm_features=mm or None, lora_request=lora,
    )  # fmt: skip


def engine_configs(
    node_url: str, lay: KVLayout, *, packing: str | None = "split_tokens", blend: bool = False,
    policy: str = "recompute", lookup_timeout_s: float | None = 30.0,
    served_model_name: str | None = "tiny", model_path: str | None = "/models/tiny-llama",
    hf_config: Mapping[str, object] | None = None, kv_role: str = "kv_both",
    parallel: ParallelConfig | None = None, backend: str | None = None, **extra: object,
) -> tuple[VllmConfig, KVCacheConfig]:  # fmt: skip
    """vLLM's config of an engine of the toy model's ``lay`` on ``node_url``, and its KV cache
    config (one full-attention group of :data:`BLOCK`-token blocks).
    ``packing``: ``kv_packing`` (``None``: not set, the connector reads the attention
    backend's); ``lookup_timeout_s``: the scheduler's wait for a lookup — 30 s here, as long as
    the nodes give the coordinator for a blend lookup: on a loaded test machine one through
    the fleet may take seconds; ``None``: the connector's default (2 s).
    ``model_path``, ``served_model_name``: ``vllm serve MODEL_PATH --served-model-name
    NAME`` (``None``: no ``--served-model-name``; ``model_path=None``: a config without a
    model); ``hf_config``: the model's ``config.json`` (default: :func:`llama_config` of
    ``lay``); ``kv_role``, ``parallel``: vLLM's (default: ``kv_both``, no parallelism);
    ``backend``: every attention layer's backend name in vLLM's ``static_forward_context``,
    as the model's build registers its layers (``None``: no layer registered);
    ``extra``: more ``kv_connector_extra_config`` keys."""
    if lookup_timeout_s is not None:
        extra["lookup_timeout_s"] = lookup_timeout_s
    if packing is not None:
        extra["kv_packing"] = packing
    kv_config = KVTransferConfig(
        kv_connector="KvatlasConnector", kv_connector_module_path="kvatlas.connector",
        kv_role=kv_role, kv_load_failure_policy=policy,  # type: ignore[arg-type]
        kv_connector_extra_config={"node_url": node_url, "blend": blend, **extra},
    )  # fmt: skip
    vllm_config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kv_config,
        device_config=DeviceConfig(device="cpu"), parallel_config=parallel or ParallelConfig(),
    )  # fmt: skip
    if model_path is not None:
        # The fields of vLLM's ModelConfig the connector reads, as vLLM sets them (its
        # served name falls back to the model; hf_config and hf_text_config read from the
        # model's config.json by vLLM's get_config). A real ModelConfig inspects the
        # model's architecture, importing modules this CPU install of vLLM leaves out.
        hf, hf_text = hf_configs(hf_config or llama_config(lay))
        vllm_config.model_config = SimpleNamespace(  # type: ignore[assignment]
            model=model_path, served_model_name=served_model_name or model_path,
            hf_config=hf, hf_text_config=hf_text,
        )  # fmt: skip
    if backend is not None:
        attn = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend))
        context = vllm_config.compilation_config.static_forward_context
        context.update(dict.fromkeys(layer_names(lay.num_layers), attn))
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=lay.num_kv_heads, head_size=lay.head_dim,
        dtype=getattr(torch, lay.dtype),
    )  # fmt: skip
    cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layer_names(lay.num_layers), kv_cache_spec=spec)],
    )  # fmt: skip
    return vllm_config, cache_config


@dataclass
class Engine:
    """One vLLM engine: a scheduler-side and a worker-side connector, a paged CPU cache."""

    scheduler: KvatlasConnector
    worker: KvatlasConnector
    pages: dict[str, torch.Tensor]
    model: ToyRopeModel
    packing: str
    free: list[int] = field(default_factory=lambda: list(range(NUM_BLOCKS))[::-1])  # never reused
    load_errors: list[set[int]] = field(default_factory=list)

    @classmethod
    def start(cls, node_url: str, model: ToyRopeModel, *, packing: str | None = "split_tokens",
              **settings: Any) -> Engine:  # fmt: skip
        """A scheduler-side and a worker-side connector of :func:`engine_configs` (``packing``
        and ``settings`` as there), the worker's cache registered; the cache is written in
        ``packing``, else in the packing of the ``backend`` setting."""
        lay = model.layout
        vllm_config, cache_config = engine_configs(node_url, lay, packing=packing, **settings)
        names = cache_config.kv_cache_groups[0].layer_names
        spec = cache_config.kv_cache_groups[0].kv_cache_spec
        sched = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.SCHEDULER, cache_config
        )
        worker = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, cache_config
        )
        assert isinstance(sched, KvatlasConnector) and isinstance(worker, KvatlasConnector)
        pages = {
            n: torch.full((NUM_BLOCKS, lay.num_kv_heads, BLOCK, 2 * lay.head_dim), float("nan"),
                          dtype=spec.dtype)
            for n in names
        }  # fmt: skip
        worker.register_kv_caches(pages)
        return cls(sched, worker, pages, model, packing or BACKEND_PACKINGS[settings["backend"]])

    # -- the scheduler's side of one request -----------------------------------------

    def match(self, request: Request, local: int = 0) -> int:
        """``get_num_new_matched_tokens`` (``local``: the tokens vLLM's own prefix cache
        holds), asked again while it answers ``None`` (a pending blend lookup), as vLLM's
        scheduler does on its next steps."""
        answers: list[tuple[int | None, bool]] = []
        asked = wait_for(
            lambda: (
                answers.append(self.scheduler.get_num_new_matched_tokens(request, local))
                or answers[-1][0] is not None
            ),
            timeout=30,
        )
        matched, is_async = answers[-1]
        assert asked and matched is not None and is_async is False
        return matched

    def run(self, request: Request, *, budget: int = 1 << 30, local: int = 0) -> RunResult:
        """Schedule ``request`` from nothing computed to its whole prompt, ``budget`` tokens
        per step (chunked prefill), each step run through the worker; then finish it.
        ``local``: the leading tokens vLLM's own prefix cache holds (a multiple of the block
        size), their KV in the request's first blocks already."""
        matched = self.match(request, local)
        n_blocks = -(-request.num_tokens // BLOCK)
        block_ids = [self.free.pop() for _ in range(n_blocks)]
        if local:
            held = self.model.kv_chunk(np.asarray(request.all_token_ids[:local], np.int64), 0)
            for layer, name in enumerate(self.pages):
                self.write(name, block_ids, 0, torch.from_numpy(held[layer]))
        blocks = KVCacheBlocks((tuple(KVCacheBlock(b) for b in block_ids),))
        self.scheduler.update_state_after_alloc(request, blocks, matched)
        computed, first = local + matched, True
        loaded_rows: dict[str, torch.Tensor] = {}
        while computed < request.num_tokens:
            step = min(budget, request.num_tokens - computed)
            rows = self.step(request, block_ids, computed, step, new=first,
                             sync_loads=first and matched > 0)  # fmt: skip
            if first:
                loaded_rows = rows
            computed += step
            first = False
        finished = self.scheduler.request_finished(request, block_ids)
        assert finished == (False, None)
        return RunResult(matched, block_ids, loaded_rows)

    def step(
        self, request: Request, block_ids: list[int], computed: int, n: int, *, new: bool,
        sync_loads: bool = False,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """One step computing ``n`` tokens of ``request`` from ``computed``: scheduled as a new
        request (``new``: its first step, or a streaming session's next turn) or a running
        one, the connector's metadata built, the worker's forward run (as :meth:`_worker_step`
        returns)."""
        rid = request.request_id
        if new:
            request.num_computed_tokens = computed  # as the scheduler sets it
            news = [NewRequestData.from_request(request, (block_ids,))]
            cached = CachedRequestData.make_empty()
        else:
            news = []
            cached = CachedRequestData(
                req_ids=[rid], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                new_block_ids=[None], num_computed_tokens=[computed], num_output_tokens=[0],
            )  # fmt: skip
        out = SchedulerOutput(
            scheduled_new_reqs=news, scheduled_cached_reqs=cached,
            num_scheduled_tokens={rid: n}, total_num_scheduled_tokens=n,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[], has_sync_kv_loads=sync_loads,
        )  # fmt: skip
        out.kv_connector_metadata = self.scheduler.build_connector_meta(out)
        return self._worker_step(out, request, block_ids, computed, n)

    # -- the worker's side of one step ------------------------------------------------

    def _worker_step(
        self, out: SchedulerOutput, request: Request, block_ids: list[int], start: int, n: int
    ) -> dict[str, torch.Tensor]:
        """One forward: returns each layer's K and V rows ``[0, start)`` as the layer saw them
        (what the connector loaded) before computing tokens ``[start, start + n)``."""
        w = self.worker
        assert out.kv_connector_metadata is not None
        w.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)  # type: ignore[arg-type]
        tokens = np.asarray(request.all_token_ids[start : start + n], dtype=np.int64)
        kv = self.model.kv_chunk(tokens, start)  # [L, 2, n, H, D]: the layers' new KV
        seen = {}
        for layer, name in enumerate(self.pages):
            w.wait_for_layer_load(name)
            seen[name] = self.rows(name, block_ids, 0, start)
            self.write(name, block_ids, start, torch.from_numpy(kv[layer]))
            w.save_kv_layer(name, self.pages[name], None)  # type: ignore[arg-type]
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        w.get_transfer_results(out.finished_req_ids)
        self.load_errors.append(w.get_block_ids_with_load_errors())
        w.clear_connector_metadata()
        return seen

    def rows(self, name: str, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """``[2, end - start, H, D]``: K and V of tokens ``[start, end)`` in the paged cache."""
        k, v = kv_planes(self.pages[name], self.packing, self.model.layout.head_dim)
        t = torch.arange(start, end)
        b, r = torch.as_tensor(block_ids)[t // BLOCK], t % BLOCK
        return torch.stack([k[b, :, r], v[b, :, r]])

    def write(self, name: str, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
        k, v = kv_planes(self.pages[name], self.packing, self.model.layout.head_dim)
        t = torch.arange(start, start + kv.shape[1])
        b, r = torch.as_tensor(block_ids)[t // BLOCK], t % BLOCK
        k[b, :, r], v[b, :, r] = kv[0], kv[1]

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@dataclass
class RunResult:
    matched: int
    block_ids: list[int]
    loaded: dict[str, torch.Tensor]  # per layer [2, matched, H, D] as the first forward saw it

    def stack(self) -> Any:
        return torch.stack(list(self.loaded.values()))  # [L, 2, matched, H, D]
