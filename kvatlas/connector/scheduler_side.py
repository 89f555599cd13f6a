"""The connector in vLLM's scheduler process: how many tokens the node can supply, and which
loads and stores each step's workers perform.

vLLM's scheduler treats every token a connector claims as computed: it computes only what
follows. So a claim is always one contiguous run from the tokens vLLM already has: the node's
prefix hit, then (with ``blend``) fragments that continue it, or vLLM's own prefix when that is
longer, exactly, none after a gap. A
fragment's KV was computed after another context, so it is an approximation (CacheBlend
without its recompute); a request that used one stores nothing from its first fragment on,
so approximate KV never reaches the node under an exact prefix key. Only prompt chunks are
stored, each once, in the step that computes its last token. Nothing is claimed from a node
whose layout (chunk size, model, ...) is no longer the one checked at start: its hits are in
its new layout, and the worker would load none of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvatlas.checks import uint32_token_bytes
from kvatlas.client import EngineLayout
from kvatlas.client.engine_client import WireSegment
from kvatlas.connector.metadata import (
    KvatlasConnectorMetadata,
    LoadOp,
    RequestKeys,
    StoreOp,
)
from kvatlas.connector.node_link import NodeLink
from kvatlas.keys import MMItem

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """A lookup's answer for one request: the node holds ``[0, prefix_hit)``, vLLM had
    ``local`` tokens when it asked, and ``segments`` continue the longer of the two to
    ``covered``."""

    keys: RequestKeys
    local: int
    prefix_hit: int
    segments: tuple[WireSegment, ...]
    covered: int


@dataclass(slots=True)
class Tracked:
    """A scheduled request's store bookkeeping."""

    keys: RequestKeys
    block_ids: list[int]
    stored_chunks: int  # chunks the node holds already (its prefix hit) or that were saved
    store_limit: int  # tokens that may be stored: the prompt, cut before the first fragment
    cut: bool = False  # store_limit is a fragment's start: no later prompt token is exact


def request_keys(request: Request) -> RequestKeys | None:
    """The node's keys of ``request`` (``None``: no token ids, e.g. prompt embeddings, or a
    LoRA adapter: the engine API's keys do not carry it, so its KV would share the base
    model's keys and load into, or from, requests of another adapter)."""
    if (
        request.prompt_token_ids is None
        or request.prompt_embeds is not None
        or request.lora_request is not None
    ):
        return None
    items = tuple(
        MMItem.of(f.identifier, f.mm_position.offset, f.mm_position.length)
        for f in request.mm_features
    )
    return RequestKeys(
        request.request_id,
        uint32_token_bytes(request.prompt_token_ids),
        request.cache_salt or "",
        items,
    )


class SchedulerSide:
    def __init__(
        self, node: NodeLink, layout: EngineLayout, *, blend: bool, load: bool = True,
        store: bool = True,
    ) -> None:  # fmt: skip
        """``load``, ``store``: vLLM's ``kv_role`` (``is_kv_consumer``, ``is_kv_producer``):
        without ``load`` nothing is looked up or claimed, without ``store`` nothing stored."""
        self.node = node
        self.layout = layout  # the node's, checked against vLLM's at start
        self.chunk_size = layout.chunk_size
        self.blend = blend
        self.load = load
        self.store = store
        self._plans: dict[str, Plan] = {}
        self._tracked: dict[str, Tracked] = {}
        self._loads: list[LoadOp] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        keys = request_keys(request)
        if keys is None or not self.load:
            return 0, False
        plan = self._lookup(keys, num_computed_tokens)
        self._plans.pop(request.request_id, None)
        if plan is None:
            return None, False  # the fleet leg of a blend lookup is pending: ask again
        # vLLM must compute at least the last token itself (it samples from its logits).
        usable = min(plan.covered, request.num_tokens - 1)
        claim = max(0, usable - num_computed_tokens)
        if claim and not self.node.same_layout(self.layout):
            return 0, False  # the hit is in the node's new layout: nothing to load, no plan
        self._plans[request.request_id] = plan
        return claim, False

    def _lookup(self, keys: RequestKeys, local: int) -> Plan | None:
        tokens, salt, items = keys.token_ids(), keys.cache_salt, keys.mm_items
        hit = self.node.call(
            "lookup",
            lambda c: c.lookup(tokens, cache_salt=salt, request_id=keys.request_id, mm_items=items),
            0,
        )  # fmt: skip
        segments: tuple[WireSegment, ...] = ()
        # the run so far: the node's prefix, or vLLM's own when longer (a fragment that
        # continues vLLM's prefix cache follows no gap)
        covered = max(hit, local)
        if self.blend:
            nothing: list[WireSegment] | None = []
            found = self.node.call(
                "blend_lookup",
                lambda c: c.blend_segments(
                    tokens, keys.request_id, prefix_len=covered, cache_salt=salt, mm_items=items
                ),
                nothing,
            )  # fmt: skip
            if found is None:
                return None
            used = []
            for seg in sorted(found, key=lambda s: s.cur_st):
                if seg.cur_st != covered:
                    break  # vLLM computes everything after the first gap
                used.append(seg)
                covered += seg.length
            segments = tuple(used)
        return Plan(keys, local, hit, segments, covered)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        keys = plan.keys if plan is not None else request_keys(request)
        if keys is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        # a request scheduled again: preempted, or a streaming session's next turn (vLLM
        # appended it to the prompt: its keys and limit are the longer prompt's, unless a
        # fragment cut the stores, which stay cut)
        old = self._tracked.get(rid)
        cut = old is not None and old.cut
        tracked = Tracked(
            keys, block_ids,
            stored_chunks=max(old.stored_chunks if old else 0, (plan.prefix_hit if plan else 0) // self.chunk_size),
            store_limit=old.store_limit if old and cut else request.num_prompt_tokens, cut=cut,
        )  # fmt: skip
        self._tracked[rid] = tracked
        if plan is None or num_external_tokens <= 0:
            return
        start, end = plan.local, plan.local + num_external_tokens
        segments = tuple(s for s in plan.segments if s.cur_st < end)
        if segments:
            tracked.store_limit = min(tracked.store_limit, segments[0].cur_st)
            tracked.cut = True
        self._loads.append(
            LoadOp(keys, start, end, min(plan.prefix_hit, end), segments, tuple(block_ids))
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvatlasConnectorMetadata:
        meta = KvatlasConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_store(meta, tracked, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                tracked.block_ids = list(new_ids[0])
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_store(meta, tracked, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _plan_store(self, meta: KvatlasConnectorMetadata, tracked: Tracked, computed: int) -> None:
        """Save the chunks whose every token is computed once this step ends."""
        c = self.chunk_size
        ready = min(computed, tracked.store_limit) // c
        if ready <= tracked.stored_chunks or not self.store:
            return
        # the whole prompt and every item, as the lookup and the retrieve send them: the node
        # derives each chunk's key from the same input (an item past the stored chunks'
        # tokens, sent with those tokens only, made the node refuse the call as a placeholder
        # span outside the prompt)
        first = tracked.stored_chunks
        meta.stores.append(StoreOp(tracked.keys, first, ready - first, tuple(tracked.block_ids)))
        tracked.stored_chunks = ready

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish inside their step (``wait_for_save``): the blocks can be freed now."""
        self._plans.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        return False, None
