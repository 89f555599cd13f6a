"""The node's HTTP surface: peer L1 for other nodes, and an engine API for engines (and the
multi-process demo and tests) that run in another process.

Engine calls carry msgpack bodies (tokens as little-endian uint32 bytes, KV as raw bytes in the
layout's dtype) and get msgpack replies, errors included: a :class:`~kvatlas.errors.KvatlasError`
replies its own ``status`` with :func:`kvatlas.web.error_payload`; a call the node cannot make
sense of (any other ``ValueError``) is :class:`~kvatlas.errors.Unprocessable`. The peer route
keeps its JSON errors (:mod:`kvatlas.node.peer`). Blend lookups are poll-able: the node keeps
each request's tracker for a while, so the keys of every call come from the same tracker (the
single injection point).

A ``request_id`` names a tracker, it does not define the request: a call continues the held
tracker only if its MM items and salt are the same and its tokens extend the held ones
(generated tokens, appended); any other call under that id replaces the tracker with one built
from its own tokens and cancels the old one's pending blend lookup (never refused: every call
is keyed by its own tokens). Trackers are dropped at the end of a request, after a TTL and
beyond a bound. See ``docs/node.md`` ("Request ids over the engine API").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
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

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class _Identity:
    """What a call says its request is: raw tokens (prompt + generated so far), items, salt."""

    tokens: np.ndarray[Any, np.dtype[np.uint32]]
    items: tuple[tuple[str, int, int], ...]
    cache_salt: str

    def continues(self, held: _Identity) -> bool:
        """Same items and salt, and these tokens are ``held``'s followed by zero or more others."""
        n = len(held.tokens)
        return (
            self.items == held.items
            and self.cache_salt == held.cache_salt
            and len(self.tokens) >= n
            and bool(np.array_equal(self.tokens[:n], held.tokens))
        )


@dataclass
class _Entry:
    born: float
    tracker: RequestTracker
    identity: _Identity
    blend_id: str


class _Trackers:
    """Trackers of in-flight requests by ``request_id``, each with the identity it was built
    from. A call continues the held tracker only if its identity extends it (same items and
    salt, tokens = held tokens + generated ones, which are appended); any other call under the
    same id replaces it, so a reused id never keys one prompt with another's tokens. Entries
    are dropped at the end of a request (store, retrieve, blend-retrieve), after ``ttl``, and
    beyond ``max_entries`` (oldest first): memory stays bounded for aborted requests too.
    ``on_forget`` gets the blend id of each tracker replaced, expired or evicted."""

    def __init__(
        self,
        ttl: float = 120.0,
        max_entries: int = 10_000,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_forget: Callable[[str], object] = lambda blend_id: None,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.replaced = 0
        self._clock = clock
        self._on_forget = on_forget
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get_or_create(
        self, request_id: str, identity: _Identity, make: Callable[[], RequestTracker]
    ) -> tuple[RequestTracker, str]:
        """The tracker for this call and the id its blend lookup is polled under (unique per
        tracker, so a replaced request's pending lookup is never answered to its successor)."""
        now = self._clock()
        stale: list[str] = []
        with self._lock:
            while self._entries:
                rid, oldest = next(iter(self._entries.items()))
                if now - oldest.born <= self.ttl and len(self._entries) < self.max_entries:
                    break
                del self._entries[rid]
                stale.append(oldest.blend_id)
            found = self._entries.get(request_id)
            if found is not None and identity.continues(found.identity):
                extra = identity.tokens[len(found.identity.tokens) :]
                if len(extra):
                    found.tracker.append_generated(extra.tolist())
                    found.identity = identity
                return found.tracker, found.blend_id
            if found is not None:
                self.replaced += 1
                stale.append(found.blend_id)
                del self._entries[request_id]
                log.info("request id %r reused for other tokens: new tracker", request_id)
            tracker = make()
            blend_id = f"{request_id}#{next(self._serial)}"
            if request_id:
                self._entries[request_id] = _Entry(now, tracker, identity, blend_id)
        for old in stale:
            self._on_forget(old)
        return tracker, blend_id

    def drop(self, request_id: str, tracker: RequestTracker) -> None:
        """End of request: forget ``tracker`` (not a newer one that replaced it)."""
        with self._lock:
            found = self._entries.get(request_id)
            if found is not None and found.tracker is tracker:
                del self._entries[request_id]


def _reply(payload: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(payload), status_code=status, media_type=MSGPACK)


def _error_reply(exc: KvatlasError) -> Response:
    return _reply(error_payload(exc), exc.status)


def create_node_app(node: CacheNode) -> FastAPI:
    app = create_peer_app(node.l1)
    app.title = "kvatlas cache node"
    trackers = _Trackers(on_forget=node.blend.cancel)
    app.state.engine_trackers = trackers
    layout = node.layout

    async def call_of(request: Request) -> EngineCall:
        try:
            return _decoder.decode(await request.body())
        except msgspec.MsgspecError as exc:
            raise Unprocessable(f"malformed engine call: {exc}") from None

    def tracker_for(call: EngineCall) -> tuple[RequestTracker, str]:
        if len(call.tokens) % 4:
            raise Unprocessable("tokens must be little-endian uint32 bytes")
        tokens = np.frombuffer(call.tokens, dtype="<u4")
        identity = _Identity(
            tokens,
            tuple((i.identifier, i.offset, i.length) for i in call.mm_items),
            call.cache_salt,
        )

        def make() -> RequestTracker:
            items = [MMItem.of(i.identifier, i.offset, i.length) for i in call.mm_items]
            return node.tracker(
                token_ids=tokens,
                mm_items=items,
                cache_salt=call.cache_salt,
                request_id=call.request_id,
            )

        return trackers.get_or_create(call.request_id, identity, make)

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
        tracker, _ = tracker_for(call)
        kv = np.frombuffer(call.kv, dtype=layout.numpy_dtype())
        if kv.size != call.n_chunks * int(np.prod(layout.shape)):
            raise Unprocessable("kv bytes do not match n_chunks x the node's KV layout")
        chunks = list(kv.reshape((call.n_chunks, *layout.shape)))
        stored = await run_in_threadpool(node.store, tracker, chunks, first_chunk=call.first_chunk)
        trackers.drop(call.request_id, tracker)
        return _reply({"stored": stored, "cacheable": tracker.cacheable})

    @app.post("/engine/lookup")
    async def lookup(request: Request) -> Response:
        call = await call_of(request)
        tracker, _ = tracker_for(call)
        hit = await run_in_threadpool(node.lookup, tracker)
        return _reply({"hit_tokens": hit, "cacheable": tracker.cacheable})

    @app.post("/engine/retrieve")
    async def retrieve(request: Request) -> Response:
        call = await call_of(request)
        tracker, _ = tracker_for(call)
        got = await run_in_threadpool(node.retrieve, tracker)
        trackers.drop(call.request_id, tracker)
        kv = b"".join(np.ascontiguousarray(k).tobytes() for k in got.kv)
        return _reply({"hit_tokens": got.hit_tokens, "kv": kv, "sources": dict(got.sources)})

    @app.post("/engine/blend-lookup")
    async def blend_lookup(request: Request) -> Response:
        call = await call_of(request)
        tracker, blend_id = tracker_for(call)
        result = await run_in_threadpool(
            node.blend_lookup, tracker, prefix_len=call.prefix_len, request_id=blend_id
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
        tracker, blend_id = tracker_for(call)
        segments = [segment_from_wire(s) for s in call.segments]
        got = await run_in_threadpool(node.blend_retrieve, tracker, segments)
        trackers.drop(call.request_id, tracker)
        node.blend.cancel(blend_id)  # a lookup never polled to its end is not kept to its TTL
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
