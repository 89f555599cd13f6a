"""Cache node: KV chunk tiers, event emitter, local matcher, unified lookup, retrieval, re-RoPE
(docs/node.md).

The exports below load on first use: ``kvatlas node --help`` imports only ``config`` and must
not load the web stack or the compiled kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvatlas.lazy_exports import lazy_export

if TYPE_CHECKING:
    from kvatlas.node.cache_node import BlendRetrieval, CacheNode, NodeStats, Retrieved
    from kvatlas.node.config import NodeConfig
    from kvatlas.node.embedded import EmbeddedFleet
    from kvatlas.node.engine_client import EngineCallError, NodeEngineClient
    from kvatlas.node.kv_layout import KVLayout
    from kvatlas.node.rope import rerope_chunks, rerope_k
    from kvatlas.node.segments import FetchCost, Segment
    from kvatlas.node.server import NodeProcess
    from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk
    from kvatlas.node.toy_model import ToyRopeModel
    from kvatlas.node.unified_lookup import LookupResult, UnifiedBlendLookup

_EXPORTS = {
    "BlendRetrieval": "cache_node",
    "CacheNode": "cache_node",
    "ChunkDecodeError": "stored_chunk",
    "EmbeddedFleet": "embedded",
    "EngineCallError": "engine_client",
    "FetchCost": "segments",
    "KVLayout": "kv_layout",
    "LookupResult": "unified_lookup",
    "NodeConfig": "config",
    "NodeEngineClient": "engine_client",
    "NodeProcess": "server",
    "NodeStats": "cache_node",
    "Retrieved": "cache_node",
    "Segment": "segments",
    "StoredChunk": "stored_chunk",
    "ToyRopeModel": "toy_model",
    "UnifiedBlendLookup": "unified_lookup",
    "rerope_chunks": "rope",
    "rerope_k": "rope",
}
__all__ = [
    "BlendRetrieval",
    "CacheNode",
    "ChunkDecodeError",
    "EmbeddedFleet",
    "EngineCallError",
    "FetchCost",
    "KVLayout",
    "LookupResult",
    "NodeConfig",
    "NodeEngineClient",
    "NodeProcess",
    "NodeStats",
    "Retrieved",
    "Segment",
    "StoredChunk",
    "ToyRopeModel",
    "UnifiedBlendLookup",
    "rerope_chunks",
    "rerope_k",
]


def __getattr__(name: str) -> Any:
    return lazy_export(__name__, _EXPORTS, globals(), name)
