"""What the scheduler side tells the worker side each step (vLLM's ``KVConnectorMetadata``).

Each operation carries everything a worker needs to call its node on its own: the request's
tokens (the node keys every call by them, prefix-chained), its cache salt and multimodal items
(without them a lookup keyed by token ids alone could hit another image's KV), and the block
ids its tokens occupy. The metadata crosses a process boundary (pickled), so it holds plain
values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvatlas.client.engine_client import WireSegment
from kvatlas.keys import MMItem


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """How the node keys a request: ``tokens`` (uint32 LE), cache salt, multimodal items."""

    request_id: str
    tokens: bytes
    cache_salt: str
    mm_items: tuple[MMItem, ...]

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<u4")


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Load tokens ``[start, end)`` into ``block_ids``: the ones below ``prefix_hit`` from the
    node's prefix retrieval, the rest from ``segments`` (blend retrieval, re-RoPE'd)."""

    keys: RequestKeys
    start: int
    end: int
    prefix_hit: int
    segments: tuple[WireSegment, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoreOp:
    """Save chunks ``[first_chunk, first_chunk + n_chunks)`` from ``block_ids``; ``keys`` are
    the request's whole prompt and items, as its lookup's (the node keys the chunks by them)."""

    keys: RequestKeys
    first_chunk: int
    n_chunks: int
    block_ids: tuple[int, ...]


@dataclass
class KvatlasConnectorMetadata(KVConnectorMetadata):
    """One step's loads and stores."""

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
