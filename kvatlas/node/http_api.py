"""The node's HTTP surface: peer L1 for other nodes, and an engine API for engines (and the
multi-process demo and tests) that run in another process.

Engine calls carry msgpack bodies (tokens as little-endian uint32 bytes, KV as raw bytes in the
layout's dtype) and get msgpack replies, errors included: a :class:`~kvatlas.errors.KvatlasError`
replies its own ``status`` with :func:`kvatlas.web.error_payload`; a call the node cannot make
sense of (any other ``ValueError``) is :class:`~kvatlas.errors.Unprocessable`. The peer route
keeps its JSON errors (:mod:`kvatlas.node.peer`). Blend lookups are poll-able: the node keeps
each request's tracker for a while, so the keys of every call come from the same tracker (the
single injection point). See ``docs/node.md``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvatlas.errors import KvatlasError, Unprocessable
from kvatlas.keys import MMItem, RequestTracker
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.peer import create_peer_app
from kvatlas.node.segments import FetchCost, Segment
from kvatlas.web import error_payload

MSGPACK = "application/msgpack"
_encoder = msgspec.msgpack.Encoder()


class WireItem(msgspec.Struct):
    identifier: str
    offset: int
    length: int


class EngineCall(msgspec.Struct):
    tokens: bytes = b""
    cache_salt: str = ""
    request_id: str = ""
    prefix_len: int = 0
    mm_items: list[WireItem] = []
    kv: bytes = b""
    n_chunks: int = 0
    first_chunk: int = 0
    segments: list[dict[str, Any]] = []


_decoder = msgspec.msgpack.Decoder(EngineCall)


def segment_to_wire(seg: Segment) -> dict[str, Any]:
    return {
        "chunk_hash": seg.chunk_hash.hex(),
        "old_st": seg.old_st,
        "cur_st": seg.cur_st,
        "length": seg.length,
        "source": seg.source,
        "cost": int(seg.cost),
        "trim": seg.trim,
    }


def segment_from_wire(obj: dict[str, Any]) -> Segment:
    return Segment(
        bytes.fromhex(obj["chunk_hash"]),
        int(obj["old_st"]),
        int(obj["cur_st"]),
        int(obj["length"]),
        obj["source"],
        int(obj.get("cost", FetchCost.UNKNOWN)),
        int(obj.get("trim", 0)),
    )


class _Trackers:
    """Trackers of in-flight requests, dropped after ``ttl`` (aborted requests stay bounded)."""

    def __init__(self, ttl: float = 120.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, RequestTracker]] = OrderedDict()

    def get_or_create(self, request_id: str, make: Callable[[], RequestTracker]) -> RequestTracker:
        now = time.monotonic()
        with self._lock:
            while self._entries:
                rid, (born, _) = next(iter(self._entries.items()))
                if now - born <= self.ttl and len(self._entries) < self.max_entries:
                    break
                del self._entries[rid]
            found = self._entries.get(request_id)
            if found is not None:
                return found[1]
            tracker = make()
            if request_id:
                self._entries[request_id] = (now, tracker)
            return tracker

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)


def _reply(payload: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(payload), status_code=status, media_type=MSGPACK)


def _error_reply(exc: KvatlasError) -> Response:
    return _reply(error_payload(exc), exc.status)


def create_node_app(node: CacheNode) -> FastAPI:
    app = create_peer_app(node.l1)
    app.title = "kvatlas cache node"
    trackers = _Trackers()
    layout = node.layout

    async def call_of(request: Request) -> EngineCall:
        try:
            return _decoder.decode(await request.body())
        except msgspec.MsgspecError as exc:
            raise Unprocessable(f"malformed engine call: {exc}") from None

    def tracker_for(call: EngineCall) -> RequestTracker:
        if len(call.tokens) % 4:
            raise Unprocessable("tokens must be little-endian uint32 bytes")

        def make() -> RequestTracker:
            tokens = np.frombuffer(call.tokens, dtype="<u4")
            items = [MMItem.of(i.identifier, i.offset, i.length) for i in call.mm_items]
            return node.tracker(
                token_ids=tokens,
                mm_items=items,
                cache_salt=call.cache_salt,
                request_id=call.request_id,
            )

        return trackers.get_or_create(call.request_id, make)

    @app.exception_handler(KvatlasError)
    async def _refused(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvatlasError)
        return _error_reply(exc)

    @app.exception_handler(ValueError)
    async def _unprocessable(_: Request, exc: Exception) -> Response:
        return _error_reply(Unprocessable(str(exc)))

    @app.post("/engine/store")
    async def store(request: Request) -> Response:
        call = await call_of(request)
        tracker = tracker_for(call)
        kv = np.frombuffer(call.kv, dtype=layout.numpy_dtype())
        if kv.size != call.n_chunks * int(np.prod(layout.shape)):
            raise Unprocessable("kv bytes do not match n_chunks x the node's KV layout")
        chunks = list(kv.reshape((call.n_chunks, *layout.shape)))
        stored = await run_in_threadpool(node.store, tracker, chunks, first_chunk=call.first_chunk)
        trackers.drop(call.request_id)
        return _reply({"stored": stored, "cacheable": tracker.cacheable})

    @app.post("/engine/lookup")
    async def lookup(request: Request) -> Response:
        call = await call_of(request)
        tracker = tracker_for(call)
        hit = await run_in_threadpool(node.lookup, tracker)
        return _reply({"hit_tokens": hit, "cacheable": tracker.cacheable})

    @app.post("/engine/retrieve")
    async def retrieve(request: Request) -> Response:
        call = await call_of(request)
        tracker = tracker_for(call)
        got = await run_in_threadpool(node.retrieve, tracker)
        trackers.drop(call.request_id)
        kv = b"".join(np.ascontiguousarray(k).tobytes() for k in got.kv)
        return _reply({"hit_tokens": got.hit_tokens, "kv": kv, "sources": dict(got.sources)})

    @app.post("/engine/blend-lookup")
    async def blend_lookup(request: Request) -> Response:
        call = await call_of(request)
        tracker = tracker_for(call)
        result = await run_in_threadpool(
            node.blend_lookup, tracker, prefix_len=call.prefix_len, request_id=call.request_id
        )
        if result is None:
            return _reply({"pending": True})
        return _reply(
            {
                "pending": False,
                "segments": [segment_to_wire(s) for s in result.segments],
                "local_matches": result.local_matches,
                "fleet_matches": result.fleet_matches,
                "fleet_used": result.fleet_used,
            }
        )

    @app.post("/engine/blend-retrieve")
    async def blend_retrieve(request: Request) -> Response:
        call = await call_of(request)
        tracker = tracker_for(call)
        segments = [segment_from_wire(s) for s in call.segments]
        got = await run_in_threadpool(node.blend_retrieve, tracker, segments)
        trackers.drop(call.request_id)
        return _reply(
            {
                "parts": [
                    {**segment_to_wire(seg), "kv": np.ascontiguousarray(kv).tobytes()}
                    for seg, kv in got.parts
                ],
                "misses": [segment_to_wire(s) for s in got.misses],
                "sources": dict(got.sources),
            }
        )

    @app.get("/engine/stats")
    async def stats() -> Response:
        return _reply(node.stats().to_wire())

    @app.get("/healthz")
    async def healthz() -> Response:
        return _reply({"status": "ok", "instance_id": node.instance_id, **node.scheme.describe()})

    return app
