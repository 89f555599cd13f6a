"""The virtual fleet's coordinator: the real directory and blend index, fed by the same events.

Engines' vLLM KV-event batches go through the coordinator's own subscriber path
(:meth:`~kvatlas.coordinator.kv_events.KvEventsSubscriber.apply`: the re-keyer from 16-token
blocks to chunks, then gated batches into the directory); nodes' stores and evictions go in as
the event batches a node's emitter sends (its L1 ``l1``/``dram``, the shared pool ``l2``,
``shared``). Scoring is :func:`~kvatlas.coordinator.route_score.score_routes` over that
directory. Nothing here keeps a second view of who holds what: only the directory does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from kvatlas.coordinator.kv_events import SubscriberSettings
from kvatlas.coordinator.kv_events.subscriber import KvEventsSubscriber
from kvatlas.coordinator.query import BlendQuery
from kvatlas.coordinator.route_score import score_routes
from kvatlas.coordinator.scoring import DEFAULT_FRAGMENT_WEIGHT, InstanceScore, Weights
from kvatlas.directory import KeyDirectory
from kvatlas.events import CONFIG, EventBatch
from kvatlas.events.model import CacheEntry
from kvatlas.events.vllm_wire import KVEvent, KVEventBatch
from kvatlas.keys import BlendMatch, BlendNamespace, KeyScheme, ObjectKey, expand_prefix_keys

MODEL: Final = "sim-model"
"""The served model's name: the engines' KV-events topic model and the nodes' key model."""
L1_BACKEND: Final = "dram"
POOL_BACKEND: Final = "pool"


class SimCoordinator:
    def __init__(self, chunk_size: int, max_engine_blocks: int) -> None:
        """``max_engine_blocks``: the re-keyer's bound (``--kv-events-max-blocks``), set by the
        caller to every block the engines can hold, as an operator would size it."""
        self.scheme = KeyScheme("blake3", chunk_size)
        scheme = self.scheme
        self.directory = KeyDirectory(
            chunk_size,
            enable_blend_lookup=True,
            hash_chunks=lambda tokens, _chunk_size: scheme.chunk_hashes(tokens),
        )
        self.namespace = BlendNamespace(MODEL, "", 1)
        self.weights = Weights.of(None, DEFAULT_FRAGMENT_WEIGHT)
        self.subscriber = KvEventsSubscriber(
            SubscriberSettings((), max_blocks=max_engine_blocks),
            scheme,
            ingest=self.directory.apply_columns,
            clear=self.directory.fence_instance,
            stop=threading.Event(),
        )
        self._seqs: dict[str, int] = {}

    # ------------------------------------------------------------------ events in

    def engine_events(self, engine_id: str, events: list[KVEvent], ts: float) -> None:
        """One engine step's KV events, as its publisher sends them."""
        if events:
            self.subscriber.apply(engine_id, MODEL, KVEventBatch(ts, events))

    def node_batch(self, node_id: str, kind: str, tier: str, backend: str,
                   entries: Sequence[CacheEntry], ts: float, *, shared: bool = False,
                   capacity_bytes: int | None = None) -> None:  # fmt: skip
        """One batch of a node's emitter (incarnation 1, seqs from 1)."""
        if not entries and kind != CONFIG:
            return
        seq = self._seqs.get(node_id, 0) + 1
        self._seqs[node_id] = seq
        batch = EventBatch(
            node_id, 1, seq, kind, tier, backend, shared, ts, tuple(entries),
            capacity_bytes=capacity_bytes, capacity_revision=1 if kind == CONFIG else None,
        )  # fmt: skip
        self.directory.consume(batch)

    # ------------------------------------------------------------------ queries

    def keys(self, chunk_hashes: Sequence[bytes]) -> list[ObjectKey]:
        return expand_prefix_keys(chunk_hashes, MODEL, 1, "")

    def blend_match(self, tokens: np.ndarray) -> list[BlendMatch]:
        return self.directory.blend_match(tokens, self.namespace)

    def score(self, tokens: np.ndarray, candidates: Sequence[str], peers: frozenset[str],
              attached: Mapping[str, str]) -> list[InstanceScore]:  # fmt: skip
        """``POST /route/score`` for ``candidates``, in process."""
        query = BlendQuery(tokens, self.namespace) if len(tokens) else None
        return score_routes(
            self.directory, self.scheme, query, candidates, peers, self.weights, attached
        )
