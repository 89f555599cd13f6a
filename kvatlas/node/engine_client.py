"""The engine client with the node's own types: a :class:`KVLayout` given up front, blend
segments as :class:`Segment` and KV as anything ``kv_dtype.to_numpy`` takes (torch tensors
included). The client itself is :class:`kvatlas.client.EngineClient`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvatlas.client.engine_client import EngineCallError, EngineClient
from kvatlas.keys import MMItem
from kvatlas.node.kv_dtype import to_numpy
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.segments import Segment, segment_of, segment_to_wire

__all__ = ["EngineCallError", "NodeEngineClient"]


class NodeEngineClient(EngineClient):
    def __init__(
        self, url: str, layout: KVLayout, *, timeout: float = 30.0, token: str | None = None
    ) -> None:
        super().__init__(url, layout, timeout=timeout, token=token)

    def store(self, tokens: Any, kv_chunks: Sequence[Any], *, cache_salt: str = "", request_id: str = "",
              mm_items: Sequence[MMItem] = (), first_chunk: int = 0) -> int:  # fmt: skip
        return super().store(
            tokens, [to_numpy(k) for k in kv_chunks], cache_salt=cache_salt,
            request_id=request_id, mm_items=mm_items, first_chunk=first_chunk,
        )  # fmt: skip

    def blend_lookup(
        self, tokens: Any, request_id: str, *, prefix_len: int = 0, cache_salt: str = ""
    ) -> list[Segment] | None:
        wire = self.blend_segments(tokens, request_id, prefix_len=prefix_len, cache_salt=cache_salt)
        return None if wire is None else [segment_of(s) for s in wire]

    def blend_retrieve(
        self, tokens: Any, request_id: str, segments: Sequence[Segment], *, cache_salt: str = ""
    ) -> dict[str, Any]:
        wire = [segment_to_wire(s) for s in segments]
        got = self.blend_parts(tokens, request_id, wire, cache_salt=cache_salt)
        return {
            "parts": [(segment_of(s), kv) for s, kv in got["parts"]],
            "misses": [segment_of(s) for s in got["misses"]],
            "sources": got["sources"],
        }
