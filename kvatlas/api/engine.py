"""A cache node's engine API (``/engine/*``, docs/node.md "Engine API"): each call's body and
reply, imported by the node (which decodes calls and encodes replies with them) and by its
clients (which encode calls and decode replies with them).

Calls travel as msgpack (``tokens``: little-endian uint32 bytes; ``kv``: raw bytes in the
node's layout dtype) or JSON (bytes as base64); a reply comes in the call's format. A call is
checked by its type when decoded — counts ≥ 0, tokens whole uint32s — and a call that fails
is a 422 naming the field. What depends on the route (a blend call's ``request_id``) or on the
node's configuration (``--max-query-tokens``, the KV layout) is checked by the node. A reply field sent only on some replies is ``UNSET`` when absent (never encoded).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from kvatlas.api.directory import KeyRow

Count = Annotated[int, msgspec.Meta(ge=0)]


class WireItem(msgspec.Struct):
    """A multimodal item of the prompt: its identifier and its token span."""

    identifier: str
    offset: int
    length: int


class WireSegment(msgspec.Struct):
    """A blend segment (``docs/node.md``, blend lookup): chunk ``chunk_hash`` (hex), stored at
    ``old_st``, reused from request position ``cur_st`` for ``length`` tokens, its first
    ``trim`` tokens dropped; ``source`` local, fleet or both; ``cost`` 0 local L1 … 3 unknown."""

    chunk_hash: str
    old_st: int
    cur_st: int
    length: int
    source: str
    cost: int = 3
    trim: int = 0


class EngineCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Every engine call's body (each call reads the fields it needs): the request's
    ``tokens`` (uint32 LE bytes), ``cache_salt``, ``request_id`` (required, not empty, by the
    blend calls: they are polled and found under it) and multimodal items; a blend lookup's
    ``prefix_len``; a store's ``kv`` (``n_chunks`` chunks in the node's layout, the request's
    chunks from ``first_chunk``); a blend retrieval's ``segments``. Unset fields are not
    sent."""

    tokens: bytes = b""
    cache_salt: str = ""
    request_id: str = ""
    prefix_len: Count = 0
    mm_items: list[WireItem] = []
    kv: bytes = b""
    n_chunks: Count = 0
    first_chunk: Count = 0
    segments: list[WireSegment] = []

    def __post_init__(self) -> None:
        if len(self.tokens) % 4:
            raise ValueError("tokens must be little-endian uint32 bytes")


class StoreReply(msgspec.Struct, kw_only=True):
    """How many chunks were stored; ``reason`` only when fewer than sent."""

    stored: int
    cacheable: bool
    reason: str | UnsetType = UNSET


class HitReply(msgspec.Struct):
    """``/engine/lookup``: how many leading tokens a tier or a peer holds."""

    hit_tokens: int
    cacheable: bool


class RetrieveReply(msgspec.Struct):
    """``/engine/retrieve``: the leading chunks held anywhere, back to back in the node's
    layout, and how many came from each source."""

    hit_tokens: int
    kv: bytes
    sources: dict[str, int]


class BlendLookupReply(msgspec.Struct, kw_only=True):
    """``/engine/blend-lookup``: ``pending`` (poll again) or the segments to reuse and how
    many matches each leg found (``fleet_used``: the fleet's answer came in time)."""

    pending: bool
    segments: list[WireSegment] | UnsetType = UNSET
    local_matches: int | UnsetType = UNSET
    fleet_matches: int | UnsetType = UNSET
    fleet_used: bool | UnsetType = UNSET


class BlendPart(WireSegment):
    """A retrieved segment and its KV (the layout's shape with ``length`` tokens)."""

    kv: bytes = b""


class BlendRetrieveReply(msgspec.Struct):
    """``/engine/blend-retrieve``: the parts found, the segments missed, the sources."""

    parts: list[BlendPart]
    misses: list[WireSegment]
    sources: dict[str, int]


class EngineLayout(msgspec.Struct, frozen=True):
    """``GET /engine/layout``: the node's KV layout and key scheme. A chunk's KV is an array
    :attr:`shape` ``= [num_layers, 2 (K, V), chunk_size, num_kv_heads, head_dim]`` of ``dtype``."""

    model_name: str
    hash_scheme: str
    chunk_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rotary_dim: int
    rope_style: str
    rope_theta: float
    world_size: int
    rank: int
    kv_rank: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.chunk_size, self.num_kv_heads, self.head_dim)

    def numpy_dtype(self) -> np.dtype[Any]:
        if self.dtype != "bfloat16":
            return np.dtype(self.dtype)
        import ml_dtypes

        bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bfloat16


class InventoryRow(msgspec.Struct):
    """One placement a node's own tiers hold."""

    key: KeyRow
    tier: str
    backend: str


class InventoryReply(msgspec.Struct):
    """``GET /engine/inventory`` (an admin or salt-unbound engine token)."""

    instance_id: str
    placements: list[InventoryRow]


class NodeHealthReply(msgspec.Struct):
    """A node's ``GET /healthz``: its id and the key scheme its peers must share
    (``hash_scheme``, ``chunk_size``: the flags' names)."""

    status: str
    instance_id: str
    hash_scheme: str
    chunk_size: int
