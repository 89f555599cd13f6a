"""Client of a node's engine API (what an engine in another process calls; used by the
multi-process demo and tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import msgspec
import numpy as np

from kvatlas.errors import Unavailable
from kvatlas.keys import MMItem
from kvatlas.node.http_api import MSGPACK, segment_from_wire, segment_to_wire
from kvatlas.node.kv_dtype import to_numpy
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.segments import Segment

_encoder = msgspec.msgpack.Encoder()


class EngineCallError(Unavailable):
    """The node refused or failed an engine call (an ``Unavailable``, so a ``RuntimeError`` as
    before); ``reply_status`` is the node's HTTP status, as for the coordinator client's
    ``CoordinatorError``."""

    def __init__(self, message: str, reply_status: int) -> None:
        super().__init__(message)
        self.reply_status = reply_status


class NodeEngineClient:
    """``token``: the engine bearer token (a node with auth on needs one, bound to the salts
    this engine uses)."""

    def __init__(
        self, url: str, layout: KVLayout, *, timeout: float = 30.0, token: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.layout = layout
        headers = {"Accept": MSGPACK}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

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
            fields["tokens"] = np.asarray(tokens, dtype="<u4").tobytes()
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
              mm_items: Sequence[MMItem] = ()) -> int:  # fmt: skip
        kv = b"".join(
            np.ascontiguousarray(to_numpy(k), dtype=self.layout.numpy_dtype()).tobytes()
            for k in kv_chunks
        )
        reply = self._call(
            "/engine/store", tokens=tokens, kv=kv, n_chunks=len(kv_chunks), cache_salt=cache_salt,
            request_id=request_id, mm_items=mm_items,
        )  # fmt: skip
        return int(reply["stored"])

    def lookup(
        self, tokens: Any, *, cache_salt: str = "", request_id: str = "",
        mm_items: Sequence[MMItem] = (),
    ) -> int:  # fmt: skip
        reply = self._call(
            "/engine/lookup", tokens=tokens, cache_salt=cache_salt, request_id=request_id,
            mm_items=mm_items,
        )  # fmt: skip
        return int(reply["hit_tokens"])

    def retrieve(
        self, tokens: Any, *, cache_salt: str = "", request_id: str = ""
    ) -> tuple[list[Any], dict[str, int]]:
        """Prefix retrieval: the KV of the leading chunks any tier has, and where each came from."""
        reply = self._call(
            "/engine/retrieve", tokens=tokens, cache_salt=cache_salt, request_id=request_id
        )
        flat = np.frombuffer(reply["kv"], dtype=self.layout.numpy_dtype())
        chunks = list(flat.reshape((-1, *self.layout.shape))) if flat.size else []
        return chunks, dict(reply["sources"])

    def blend_lookup(
        self, tokens: Any, request_id: str, *, prefix_len: int = 0, cache_salt: str = ""
    ) -> list[Segment] | None:
        reply = self._call(
            "/engine/blend-lookup",
            tokens=tokens,
            request_id=request_id,
            prefix_len=prefix_len,
            cache_salt=cache_salt,
        )
        if reply["pending"]:
            return None
        return [segment_from_wire(s) for s in reply["segments"]]

    def blend_retrieve(
        self, tokens: Any, request_id: str, segments: Sequence[Segment], *, cache_salt: str = ""
    ) -> dict[str, Any]:
        reply = self._call(
            "/engine/blend-retrieve", tokens=tokens, request_id=request_id, cache_salt=cache_salt,
            segments=[segment_to_wire(s) for s in segments],
        )  # fmt: skip
        shape = self.layout.shape
        parts = []
        for part in reply["parts"]:
            kv = np.frombuffer(part.pop("kv"), dtype=self.layout.numpy_dtype())
            seg = segment_from_wire(part)
            parts.append((seg, kv.reshape(shape[0], shape[1], seg.length, *shape[3:])))
        return {
            "parts": parts,
            "misses": [segment_from_wire(s) for s in reply["misses"]],
            "sources": reply["sources"],
        }

    def stats(self) -> dict[str, Any]:
        return dict(self._payload("/engine/stats", self._http.get("/engine/stats")))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> NodeEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
