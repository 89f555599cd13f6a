"""Client of a cache node's engine API (docs/node.md, "Engine API"). Calls and replies are the
API's wire types (:mod:`kvatlas.api.engine`), the ones the node decodes and encodes.

:class:`EngineClient` reads the node's KV layout from ``GET /engine/layout`` unless given one,
so an engine names only the node's URL (and its engine token). Calls travel as msgpack (tokens
as little-endian uint32 bytes, KV as raw bytes in the layout's dtype); a JSON call (bytes as
base64) gets the same replies in JSON. Light on import: httpx, msgspec and numpy only
(``ml_dtypes`` loads on the first bfloat16 layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Protocol, TypeVar

import httpx
import msgspec
import numpy as np

from kvatlas.api.engine import (
    BlendLookupReply,
    BlendRetrieveReply,
    EngineCall,
    EngineLayout,
    HitReply,
    InventoryReply,
    InventoryRow,
    RetrieveReply,
    StoreReply,
    WireItem,
    WireSegment,
)
from kvatlas.checks import uint32_token_bytes
from kvatlas.client.coordinator_client import auth_headers
from kvatlas.errors import Unavailable
from kvatlas.keys import MMItem

__all__ = [
    "MSGPACK",
    "ChunkLayout",
    "EngineCallError",
    "EngineClient",
    "EngineLayout",
    "WireItem",
    "WireSegment",
]

MSGPACK: Final = "application/msgpack"
_encoder = msgspec.msgpack.Encoder()
R = TypeVar("R")
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


ENGINE_REPLIES: Final[dict[str, type[Any]]] = {
    "/engine/store": StoreReply,
    "/engine/lookup": HitReply,
    "/engine/retrieve": RetrieveReply,
    "/engine/blend-lookup": BlendLookupReply,
    "/engine/blend-retrieve": BlendRetrieveReply,
}
"""Each engine call's reply type, by path (every call's body is an :class:`EngineCall`)."""


def _decoder(reply: type[R]) -> msgspec.msgpack.Decoder[R]:
    found = _decoders.get(reply)
    if found is None:
        found = _decoders[reply] = msgspec.msgpack.Decoder(reply)
    return found


class ChunkLayout(Protocol):
    """What the client needs of a layout (:class:`EngineLayout`, the node's ``KVLayout``)."""

    @property
    def shape(self) -> tuple[int, int, int, int, int]: ...

    def numpy_dtype(self) -> np.dtype[Any]: ...


class EngineCallError(Unavailable):
    """The node refused or failed an engine call (an ``Unavailable``, so a ``RuntimeError``);
    ``reply_status`` is the node's HTTP status, as for the coordinator client's
    ``CoordinatorError``."""

    def __init__(self, message: str, reply_status: int) -> None:
        super().__init__(message)
        self.reply_status = reply_status


class EngineClient:
    """An engine's client of one node. ``token``: the engine bearer token (a node with auth on
    needs one, bound to the salts this engine uses); ``layout``: read from the node if not
    given. KV chunks are numpy arrays of :attr:`layout`'s shape and dtype."""

    def __init__(
        self,
        url: str,
        layout: ChunkLayout | None = None,
        *,
        timeout: float = 30.0,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Accept": MSGPACK, **auth_headers(token)}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)
        self.layout: ChunkLayout = self.node_layout() if layout is None else layout

    def node_layout(self) -> EngineLayout:
        """``GET /engine/layout``."""
        return self._reply("/engine/layout", self._http.get("/engine/layout"), EngineLayout)

    def _reply(self, path: str, response: httpx.Response, reply: type[R]) -> R:
        """The node's reply as its wire type, or :class:`EngineCallError` (a refusal, with
        its ``detail``; a reply that is not of its type)."""
        if response.status_code != 200:
            try:
                payload: Any = msgspec.msgpack.decode(response.content)
            except msgspec.DecodeError:
                payload = response.text
            raise EngineCallError(f"{path}: {response.status_code} {payload}", response.status_code)
        try:
            return _decoder(reply).decode(response.content)
        except msgspec.DecodeError as exc:
            raise EngineCallError(f"{path}: malformed reply: {exc}", response.status_code) from None

    def _call(self, path: str, **fields: Any) -> Any:
        """``path``'s call made of ``fields`` (``tokens`` as ids, ``mm_items`` as
        :class:`MMItem`), and its reply as its type (:data:`ENGINE_REPLIES`)."""
        tokens = fields.pop("tokens", None)
        if tokens is not None:
            fields["tokens"] = uint32_token_bytes(tokens)
        fields["mm_items"] = [
            WireItem(i.identifier, i.span.offset, i.span.length) for i in fields.pop("mm_items", ())
        ]
        response = self._http.post(
            path, content=_encoder.encode(EngineCall(**fields)), headers={"Content-Type": MSGPACK}
        )
        return self._reply(path, response, ENGINE_REPLIES[path])

    def store(self, tokens: Any, kv_chunks: Sequence[Any], *, cache_salt: str = "", request_id: str = "",
              mm_items: Sequence[MMItem] = (), first_chunk: int = 0) -> int:  # fmt: skip
        """Store the KV of the request's chunks ``first_chunk, first_chunk + 1, ...`` (``tokens``
        from the request's start); returns how many were stored."""
        dtype = self.layout.numpy_dtype()
        kv = b"".join(np.ascontiguousarray(k, dtype=dtype).tobytes() for k in kv_chunks)
        reply: StoreReply = self._call(
            "/engine/store", tokens=tokens, kv=kv, n_chunks=len(kv_chunks), cache_salt=cache_salt,
            request_id=request_id, mm_items=mm_items, first_chunk=first_chunk,
        )  # fmt: skip
        return reply.stored

    def lookup(
        self, tokens: Any, *, cache_salt: str = "", request_id: str = "",
        mm_items: Sequence[MMItem] = (),
    ) -> int:  # fmt: skip
        """How many leading tokens some tier (or a peer) holds."""
        reply: HitReply = self._call(
            "/engine/lookup", tokens=tokens, cache_salt=cache_salt, request_id=request_id,
            mm_items=mm_items,
        )  # fmt: skip
        return reply.hit_tokens

    def retrieve(
        self, tokens: Any, *, cache_salt: str = "", request_id: str = "",
        mm_items: Sequence[MMItem] = (), first_chunk: int = 0,
    ) -> tuple[list[Any], dict[str, int]]:  # fmt: skip
        """Prefix retrieval: the KV of the leading chunks any tier has, from chunk
        ``first_chunk`` (the caller holds those before it; the first returned is that one),
        and where each came from."""
        reply: RetrieveReply = self._call(
            "/engine/retrieve", tokens=tokens, cache_salt=cache_salt, request_id=request_id,
            mm_items=mm_items, first_chunk=first_chunk,
        )  # fmt: skip
        flat = np.frombuffer(reply.kv, dtype=self.layout.numpy_dtype())
        chunks = list(flat.reshape((-1, *self.layout.shape))) if flat.size else []
        if first_chunk and chunks and reply.hit_tokens == len(chunks) * self.layout.shape[2]:
            # a node from before first_chunk answers from chunk 0 (its hit_tokens counts only
            # the chunks sent; this one's counts first_chunk's predecessors): skip to it
            chunks = chunks[first_chunk:]
        return chunks, reply.sources

    def blend_segments(
        self, tokens: Any, request_id: str, *, prefix_len: int = 0, cache_salt: str = "",
        mm_items: Sequence[MMItem] = (),
    ) -> list[WireSegment] | None:  # fmt: skip
        """Blend lookup: the segments to reuse, or ``None`` while the fleet leg is pending
        (call again with the same ``request_id``)."""
        reply: BlendLookupReply = self._call(
            "/engine/blend-lookup", tokens=tokens, request_id=request_id, prefix_len=prefix_len,
            cache_salt=cache_salt, mm_items=mm_items,
        )  # fmt: skip
        if reply.pending:
            return None
        return reply.segments or []

    def blend_parts(
        self, tokens: Any, request_id: str, segments: Sequence[WireSegment], *,
        cache_salt: str = "", mm_items: Sequence[MMItem] = (),
    ) -> dict[str, Any]:  # fmt: skip
        """Blend retrieval: ``parts`` (segment, KV re-RoPE'd to ``cur_st``: the layout's shape
        with ``length`` tokens), ``misses`` and ``sources``."""
        reply: BlendRetrieveReply = self._call(
            "/engine/blend-retrieve", tokens=tokens, request_id=request_id, cache_salt=cache_salt,
            segments=list(segments), mm_items=mm_items,
        )  # fmt: skip
        shape, dtype = self.layout.shape, self.layout.numpy_dtype()
        parts = []
        for part in reply.parts:
            kv = np.frombuffer(part.kv, dtype=dtype)
            seg = WireSegment(*msgspec.structs.astuple(part)[:-1])  # the segment, without its KV
            parts.append((seg, kv.reshape(shape[0], shape[1], seg.length, *shape[3:])))
        return {"parts": parts, "misses": reply.misses, "sources": reply.sources}

    def stats(self) -> dict[str, Any]:
        """``GET /engine/stats``: the node's figures, its counters flat beside them (an open
        set: a counter appears once counted)."""
        return self._reply("/engine/stats", self._http.get("/engine/stats"), dict[str, Any])

    def inventory(self) -> list[InventoryRow]:
        """``GET /engine/inventory``: ``{key, tier, backend}`` of every placement the node's
        own tiers hold (an admin or salt-unbound engine token)."""
        got = self._http.get("/engine/inventory")
        return self._reply("/engine/inventory", got, InventoryReply).placements

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
