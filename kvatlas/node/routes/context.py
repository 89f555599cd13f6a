"""What every node route's handler is handed: the node and the state the HTTP API keeps beside
it (held trackers, cache-control jobs, the peer route's tiers, the layout reply)."""

from __future__ import annotations

from dataclasses import dataclass

from kvatlas.api.engine import EngineLayout
from kvatlas.node.cache_control import NodeCacheControl
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.engine_trackers import Trackers
from kvatlas.node.peer import PeerServing


@dataclass(frozen=True, slots=True)
class Context:
    node: CacheNode
    trackers: Trackers
    cache_control: NodeCacheControl
    peer: PeerServing
    layout: EngineLayout

    @property
    def engine_trackers(self) -> Trackers:
        """The engine API's held trackers (``app.state.engine_trackers``)."""
        return self.trackers
