"""Client of a cache node's engine API (docs/node.md, "Engine API"), and the API's wire types
(the node parses calls with the same structs).

:class:`EngineClient` reads the node's KV layout from ``GET /engine/layout`` unless given one,
so an engine names only the node's URL (and its engine token). Calls travel as msgpack (tokens
as little-endian uint32 bytes, KV as raw bytes in the layout's dtype); a JSON call (bytes as
base64) gets the same replies in JSON. Light on import: httpx, msgspec and numpy only
(``ml_dtypes`` loads on the first bfloat16 layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Protocol

import httpx
import msgspec
import numpy as np

from kvatlas.checks import uint32_token_bytes
from kvatlas.client.coordinator_client import auth_headers
from kvatlas.errors import Unavailable
from kvatlas.keys import MMItem

MSGPACK: Final = "application/msgpack"
_encoder = msgspec.msgpack.Encoder()


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


class EngineCall(msgspec.Struct):
    """Every engine call's body (each call reads the fields it needs). ``tokens``: uint32 LE
    bytes; ``kv``: ``n_chunks`` chunks in the node's layout, starting at chunk ``first_chunk``
    (store only)."""

    tokens: bytes = b""
    cache_salt: str = ""
    request_id: str = ""
    prefix_len: int = 0
    mm_items: list[WireItem] = []
    kv: bytes = b""
    n_chunks: int = 0
    first_chunk: int = 0
    segments: list[WireSegment] = []


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
        return msgspec.convert(
            self._payload("/engine/layout", self._http.get("/engine/layout")), EngineLayout
        )

    def _payload(self, path: str, response: httpx.Response) -> Any:
        try:
            payload = msgspec.msgpack.decode(response.content)
        except msgspec.DecodeError:
            payload = response.text
        if response.status_code != 200:
            raise EngineCallError(f"{path}: {response.status_code} {payload}", response.status_code)
        return payload

    def _call(self, path: str, **fields: Any) -> Any:
        tokens = fields.pop("tokens", None)
        if tokens is not None:
            fields["tokens"] = uint32_token_bytes(tokens)
        items: Sequence[MMItem] = fields.pop("mm_items", ())
        fields["mm_items"] = [
            {"identifier": i.identifier, "offset": i.span.offset, "length": i.span.length}
            for i in items
        ]
        response = self._http.post(
            path, content=_encoder.encode(fields), headers={"Content-Type": MSGPACK}
        )
        return self._payload(path, response)

    def store(self, tokens: Any, kv_chunks: Sequence[Any], *, cache_salt: str = "", request_id: str = "",
              mm_items: Sequence[MMItem] = (), first_chunk: int = 0) -> int:  # fmt: skip
        """Store the KV of the request's chunks ``first_chunk, first_chunk + 1, ...`` (``tokens``
        from the request's start); returns how many were stored."""
        dtype = self.layout.numpy_dtype()
        kv = b"".join(np.ascontiguousarray(k, dtype=dtype).tobytes() for k in kv_chunks)
        reply = self._call(
            "/engine/store", tokens=tokens, kv=kv, n_chunks=len(kv_chunks), cache_salt=cache_salt,
            request_id=request_id, mm_items=mm_items, first_chunk=first_chunk,
        )  # fmt: skip
        return int(reply["stored"])

    def lookup(
        self, tokens: Any, *, cache_salt: str = "", request_id: str = "",
        mm_items: Sequence[MMItem] = (),
    ) -> int:  # fmt: skip
        """How many leading tokens some tier (or a peer) holds."""
        reply = self._call(
            "/engine/lookup", tokens=tokens, cache_salt=cache_salt, request_id=request_id,
            mm_items=mm_items,
        )  # fmt: skip
        return int(reply["hit_tokens"])

    def retrieve(
        self, tokens: Any, *, cache_salt: str = "", request_id: str = "",
        mm_items: Sequence[MMItem] = (),
    ) -> tuple[list[Any], dict[str, int]]:  # fmt: skip
        """Prefix retrieval: the KV of the leading chunks any tier has, and where each came from."""
        reply = self._call(
            "/engine/retrieve", tokens=tokens, cache_salt=cache_salt, request_id=request_id,
            mm_items=mm_items,
        )  # fmt: skip
        flat = np.frombuffer(reply["kv"], dtype=self.layout.numpy_dtype())
        chunks = list(flat.reshape((-1, *self.layout.shape))) if flat.size else []
        return chunks, dict(reply["sources"])

    def blend_segments(
        self, tokens: Any, request_id: str, *, prefix_len: int = 0, cache_salt: str = "",
        mm_items: Sequence[MMItem] = (),
    ) -> list[WireSegment] | None:  # fmt: skip
        """Blend lookup: the segments to reuse, or ``None`` while the fleet leg is pending
        (call again with the same ``request_id``)."""
        reply = self._call(
            "/engine/blend-lookup", tokens=tokens, request_id=request_id, prefix_len=prefix_len,
            cache_salt=cache_salt, mm_items=mm_items,
        )  # fmt: skip
        if reply["pending"]:
            return None
        return msgspec.convert(reply["segments"], list[WireSegment])

    def blend_parts(
        self, tokens: Any, request_id: str, segments: Sequence[WireSegment], *,
        cache_salt: str = "", mm_items: Sequence[MMItem] = (),
    ) -> dict[str, Any]:  # fmt: skip
        """Blend retrieval: ``parts`` (segment, KV re-RoPE'd to ``cur_st``: the layout's shape
        with ``length`` tokens), ``misses`` and ``sources``."""
        reply = self._call(
            "/engine/blend-retrieve", tokens=tokens, request_id=request_id, cache_salt=cache_salt,
            segments=[msgspec.to_builtins(s) for s in segments], mm_items=mm_items,
        )  # fmt: skip
        shape = self.layout.shape
        parts = []
        for part in reply["parts"]:
            kv = np.frombuffer(part.pop("kv"), dtype=self.layout.numpy_dtype())
            seg = msgspec.convert(part, WireSegment)
            parts.append((seg, kv.reshape(shape[0], shape[1], seg.length, *shape[3:])))
        return {
            "parts": parts,
            "misses": msgspec.convert(reply["misses"], list[WireSegment]),
            "sources": reply["sources"],
        }

    def stats(self) -> dict[str, Any]:
        return dict(self._payload("/engine/stats", self._http.get("/engine/stats")))

    def inventory(self) -> list[dict[str, Any]]:
        """``GET /engine/inventory``: ``{key, tier, backend}`` of every placement the node's
        own tiers hold (an admin or salt-unbound engine token)."""
        reply = self._payload("/engine/inventory", self._http.get("/engine/inventory"))
        return list(reply["placements"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
