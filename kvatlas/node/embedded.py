"""The embedded fleet: a coordinator's directory and several cache nodes in one process.

Same code paths as a real fleet after the transport: nodes emit events through an
:class:`~kvatlas.client.EventSink` whose transport hands batches to the directory's gate,
fleet blend lookups go to the directory's blend index, and peer L1 reads go straight to the
other node's L1 (pinned while copied). What ``make demo`` runs and most node tests use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvatlas.client import EventSink, InProcessTransport
from kvatlas.directory import KeyDirectory
from kvatlas.events import EventBatch
from kvatlas.keys import BlendMatch, BlendNamespace, ObjectKey
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.fleet_view import Holder, InProcessFleetView, PeerFetcher
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import FsL2, L2Backend, instance_dir
from kvatlas.node.peer import PeerChunk, PeerReply
from kvatlas.node.stored_chunk import StoredChunk


class InProcessBlendClient:
    """A fleet matcher over a directory in this process (answers at submit time)."""

    def __init__(self, directory: KeyDirectory) -> None:
        self._directory = directory
        self._results: dict[str, list[BlendMatch]] = {}
        self._lock = threading.Lock()

    def submit_match(self, request_id: str, tokens: Any, namespace: BlendNamespace) -> None:
        matches = self._directory.blend_match(tokens, namespace)
        with self._lock:
            self._results[request_id] = matches

    def poll_match(self, request_id: str) -> list[BlendMatch] | None:
        with self._lock:
            return self._results.get(request_id, [])

    def take_match(self, request_id: str) -> list[BlendMatch] | None:
        with self._lock:
            return self._results.pop(request_id, [])


class InProcessPeer:
    """Reads another node's tiers the way the HTTP peer does: L1 pinned while copied, its
    private L2 only when asked for ``"l2"``."""

    def __init__(self, l1: L1Cache, l2: L2Backend | None = None) -> None:
        self._l1 = l1
        self._l2 = l2 if l2 is not None and not l2.shared else None

    def fetch(self, keys: Sequence[ObjectKey], tiers: Sequence[str] = ("l1",)) -> PeerReply:
        found: dict[ObjectKey, StoredChunk | None] = {}
        if "l1" in tiers:
            with self._l1.pinned(keys):
                found = {k: self._l1.get(k) for k in keys}
        missing = [k for k in keys if found.get(k) is None]
        if "l2" in tiers and self._l2 is not None and missing:
            found.update(self._l2.get_many(missing))
        return PeerReply({k: PeerChunk(c, None) for k, c in found.items() if c is not None})


class EmbeddedFleet:
    def __init__(
        self,
        configs: Sequence[NodeConfig],
        *,
        l2_root: Path | None = None,
        enable_blend_lookup: bool = True,
        fleet_blend: bool = True,
        directory: KeyDirectory | None = None,
        consume: Callable[[EventBatch], object] | None = None,
    ) -> None:
        """``directory`` and ``consume``: a directory to use and how batches reach it (a
        coordinator service's, so its status page shows this fleet); default: a new one."""
        if not configs:
            raise ValueError("an embedded fleet needs at least one node")
        chunk_size = configs[0].chunk_size
        if any(
            c.chunk_size != chunk_size or c.hash_scheme != configs[0].hash_scheme for c in configs
        ):
            raise ValueError("all nodes of a fleet must share chunk size and key scheme")
        scheme = configs[0].scheme
        self.directory = directory or KeyDirectory(
            chunk_size,
            enable_blend_lookup=enable_blend_lookup,
            hash_chunks=lambda tokens, _c: scheme.chunk_hashes(tokens),
        )
        self.nodes: dict[str, CacheNode] = {}
        self.sinks: dict[str, EventSink] = {}
        view = InProcessFleetView(self._holders, self._peer)
        matcher = InProcessBlendClient(self.directory) if fleet_blend else None
        for i, config in enumerate(configs):
            instance_id = config.instance_id or f"node-{i}"
            l2: L2Backend | None = None
            if config.l2 == "fs" and l2_root is not None:
                shared = config.l2_shared
                l2 = FsL2(
                    l2_root if shared else instance_dir(l2_root, instance_id),
                    "fs-shared" if shared else "fs",
                    shared=shared,
                )
            sink = EventSink(instance_id, InProcessTransport(consume or self.directory.consume))
            node = CacheNode(
                config, instance_id=instance_id, l2=l2, sink=sink, fleet=view, fleet_matcher=matcher
            )
            self.nodes[instance_id] = node
            self.sinks[instance_id] = sink

    def _holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]:
        return [
            [Holder(p.instance_id, p.tier, p.backend, p.shared) for p in kp.placements]
            for kp in self.directory.lookup(list(keys))
        ]

    def _peer(self, instance_id: str) -> PeerFetcher | None:
        node = self.nodes.get(instance_id)
        return None if node is None else InProcessPeer(node.l1, node.l2)

    def settle(self, timeout: float = 10.0) -> bool:
        """Deliver every pending event so the directory reflects what the nodes did."""
        for node in self.nodes.values():
            node.flush_events()
        return all(sink.flush(timeout) for sink in self.sinks.values())

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
        for sink in self.sinks.values():
            sink.close()

    def __enter__(self) -> EmbeddedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
