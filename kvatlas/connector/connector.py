"""``KvatlasConnector``: vLLM's ``KVConnectorBase_V1`` backed by a kvatlas cache node.

vLLM builds one instance per role: in the scheduler process it answers how many tokens the
node can supply and plans each step's loads and stores (:mod:`.scheduler_side`); in each
worker it moves KV between the paged cache and the node (:mod:`.worker_side`). Both refuse
to start on a cache or layout they cannot serve exactly (hybrid groups, MLA, quantized or
packed caches, tensor, pipeline or context parallelism, a node whose layout differs from vLLM's, a
node of another model, with blend a node whose RoPE is not the model's): a wrong layout or
model would not fail, it would load wrong KV.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

from kvatlas.client import EngineLayout
from kvatlas.connector.metadata import KvatlasConnectorMetadata
from kvatlas.connector.node_link import NodeLink
from kvatlas.connector.pages import dtype_name
from kvatlas.connector.rope_check import check_rope
from kvatlas.connector.scheduler_side import SchedulerSide
from kvatlas.connector.settings import ConnectorSettings
from kvatlas.connector.worker_side import WorkerSide
from kvatlas.errors import InvalidInput

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


_PARALLEL_SIZES = (
    "tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
    "decode_context_parallel_size",
)  # fmt: skip
"""vLLM's parallelism settings that shard a request's KV across workers: each must be 1."""


def check_cache(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> FullAttentionSpec:
    """vLLM's KV cache, if this connector can serve it exactly; else a refusal naming why."""
    parallel = vllm_config.parallel_config
    sizes = {name: getattr(parallel, name) for name in _PARALLEL_SIZES}
    if any(size != 1 for size in sizes.values()):
        # each worker would hold a share of every layer's heads (tp), of the layers (pp) or of
        # every block's tokens (context parallelism), and store it under the chunk's whole key
        raise InvalidInput(
            "kvatlas connector: tensor, pipeline and context parallelism are not supported ("
            + ", ".join(f"{name}={size}" for name, size in sizes.items() if size != 1)
            + ")"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise InvalidInput(
            f"kvatlas connector: {len(groups)} KV cache groups (a hybrid model); one "
            "full-attention group is supported"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise InvalidInput(
            f"kvatlas connector: {type(spec).__name__} is not supported (full attention only)"
        )
    packed = (spec.num_head_slots, spec.state_content_bytes, spec.page_size_padded)
    if (
        spec.kv_quant_mode != KVQuantMode.NONE
        or packed != (None, None, None)
        or spec.tokens_per_state != 1
    ):
        raise InvalidInput(
            "kvatlas connector: quantized, packed or padded KV caches are not supported"
        )
    if spec.head_size_v != spec.head_size:
        raise InvalidInput("kvatlas connector: K and V head sizes differ")
    return spec


def check_layout(layout: EngineLayout, spec: FullAttentionSpec, num_layers: int) -> None:
    """The node's layout must be vLLM's cache, field for field."""
    ours = {
        "num_layers": num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_size,
        "dtype": dtype_name(spec.dtype), "world_size": 1,
    }  # fmt: skip
    theirs = {name: getattr(layout, name) for name in ours}
    if ours != theirs:
        raise InvalidInput(
            f"kvatlas connector: vLLM's KV cache {ours} is not the node's layout {theirs}"
        )
    if layout.chunk_size % spec.block_size:
        raise InvalidInput(
            f"kvatlas connector: the node's chunk_size {layout.chunk_size} is not a multiple of "
            f"vLLM's block_size {spec.block_size}"
        )


def check_model(
    layout: EngineLayout, settings: ConnectorSettings, model_config: ModelConfig | None
) -> None:
    """The node's KV must be this engine's model's: another model of the same shapes (a
    fine-tune, another revision) passes every shape check and its KV is wrong. The node's
    ``--model-name`` is a label, so the rule is exact names: ``model_name`` in
    ``kv_connector_extra_config`` when set, else vLLM's served model name or its model (the
    name or path given to ``vllm serve``). Nothing is guessed (not a path's last part: two
    fine-tunes in ``/models/a/llama`` and ``/models/b/llama`` share it)."""
    node, url = layout.model_name, settings.node_url
    key = "kv_connector_extra_config.model_name"
    if settings.model_name is not None:
        if settings.model_name != node:
            raise InvalidInput(
                f"kvatlas connector: the node at {url} holds KV of model_name {node!r} (its "
                f"--model-name), not {settings.model_name!r} ({key}): point node_url at a node "
                f"of {settings.model_name!r}, or correct {key}"
            )
        return
    if model_config is None:
        raise InvalidInput(
            f"kvatlas connector: vLLM's config names no model to compare with the node's "
            f"model_name {node!r} (at {url}); set {key} to the model whose KV this engine's "
            "node must hold"
        )
    served, model = str(model_config.served_model_name), model_config.model
    if node not in (served, model):
        raise InvalidInput(
            f"kvatlas connector: the node at {url} holds KV of model_name {node!r} (its "
            f"--model-name), not of vLLM's model: served model name {served!r}, model "
            f"{model!r}; if the node's KV is this model's, set {key} to {node!r} (or serve it "
            f"as --served-model-name {node!r}); else point node_url at a node of this model"
        )


class KvatlasConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        policy = self._kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":  # the operator's choice (vLLM's default): said, not overridden
            log.warning(
                "kvatlas connector: kv_load_failure_policy is %r (vLLM's default): a request "
                "whose chunks the node loses between lookup and load fails instead of being "
                'recomputed; set "kv_load_failure_policy": "recompute" in --kv-transfer-config '
                "(docs/vllm.md)", policy,
            )  # fmt: skip
        spec = check_cache(vllm_config, kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER  # its calls hold vLLM's scheduler
        self._node = NodeLink(settings, settings.lookup_timeout_s if scheduler else None)
        layout = self._node.layout()  # the node must be up: its layout decides everything
        check_layout(layout, spec, len(kv_cache_config.kv_cache_groups[0].layer_names))
        check_model(layout, settings, vllm_config.model_config)
        check_rope(layout, settings.node_url, settings.blend, vllm_config.model_config,
                   spec.head_size)  # fmt: skip
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            role_of = self._kv_transfer_config  # kv_role: kv_both, kv_producer, kv_consumer
            self._scheduler = SchedulerSide(
                self._node, layout, blend=settings.blend, load=role_of.is_kv_consumer,
                store=role_of.is_kv_producer,
            )  # fmt: skip
        else:
            self._worker = WorkerSide(self._node, layout, spec.block_size, settings.kv_packing)
        log.info("kvatlas connector (%s) on node %s: %s", role.name, settings.node_url, layout)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads are written in ``wait_for_layer_load`` and saves copied in ``save_kv_layer``,
        hooks a full CUDA graph's replay skips: a step vLLM runs as one (a batch of one token
        per request, e.g. a prompt the node holds but for its last token) would have every
        load written late, reported as failed and recomputed. vLLM then keeps attention out
        of the graphs (PIECEWISE)."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A kvatlas node is a best-effort cache (vLLM's default is ``is_kv_producer``, for a
        producer that hands KV off): a save dropped with a preempted request is a later miss,
        no reason to recompute the request."""
        return False

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def _meta(self) -> KvatlasConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvatlasConnectorMetadata)
        return meta

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # the model's attention layers, built before the caches (vLLM's forward context)
        layers = self._vllm_config.compilation_config.static_forward_context
        backends = {n: layers[n].attn_backend.get_name() for n in kv_caches if n in layers}
        self.worker.register_kv_caches(kv_caches, backends)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self.worker.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        self.worker.wait_for_save(meta if isinstance(meta, KvatlasConnectorMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        self._node.close()

    # -- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)
