"""The engine calls (``POST /engine/store``, ``lookup``, ``retrieve``, ``blend-lookup``,
``blend-retrieve``): each body an :class:`~kvatlas.api.engine.EngineCall` in msgpack (tokens as
little-endian uint32 bytes, KV as raw bytes in the layout's dtype) or JSON (bytes as base64),
its reply in the call's format. :func:`engine_call` turns a handler of a decoded call into a
route handler: the body decoded (large ones off the event loop), the caller's salts checked,
the required fields present; any ``ValueError`` the call provokes is a 422. Every call's keys
come from the request's held tracker (:mod:`kvatlas.node.engine_trackers`, bound to the
calling principal): the single injection point."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import numpy as np
from starlette.concurrency import run_in_threadpool

from kvatlas.api.engine import (
    BlendLookupReply,
    BlendPart,
    BlendRetrieveReply,
    EngineCall,
    HitReply,
    RetrieveReply,
    StoreReply,
)
from kvatlas.auth import Principal
from kvatlas.errors import KvatlasError, PayloadTooLarge, Unprocessable
from kvatlas.keys import MMItem, RequestTracker
from kvatlas.node.engine_trackers import Identity
from kvatlas.node.routes.context import Context
from kvatlas.node.segments import Segment, segment_of, segment_to_wire
from kvatlas.routing import MSGPACK, Call

BLEND_REQUIRED: Final = ("request_id",)
"""A blend lookup is polled, and its retrieval found, under its request id."""
OFF_LOOP_BYTES: Final = 1 << 20  # bodies above this are decoded in the thread pool
_msgpack_decoder = msgspec.msgpack.Decoder(EngineCall)
_json_decoder = msgspec.json.Decoder(EngineCall)

CallHandler = Callable[[Context, EngineCall, Principal], Awaitable[Any]]
RouteHandler = Callable[[Context, Call[None, None]], Awaitable[Any]]


def _decode_call(body: bytes, msgpack: bool) -> EngineCall:
    return _msgpack_decoder.decode(body) if msgpack else _json_decoder.decode(body)


async def _decode(body: bytes, msgpack: bool) -> EngineCall:
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await run_in_threadpool(_decode_call, body, msgpack)
        return _decode_call(body, msgpack)
    except msgspec.MsgspecError as exc:
        raise Unprocessable(f"malformed engine call: {exc}") from None


def engine_call(required: tuple[str, ...] = ()) -> Callable[[CallHandler], RouteHandler]:
    """The route handler of ``handler``: the body decoded in the call's format (the type
    checks it), the caller's salts checked, then the ``required`` fields present and not
    empty; a ``ValueError`` is a 422 (the dispatcher replies in the call's format)."""

    def wrap(handler: CallHandler) -> RouteHandler:
        @functools.wraps(handler)
        async def route(context: Context, call: Call[None, None]) -> Any:
            try:
                body = await _decode(call.raw, call.codec is MSGPACK)
                call.who.require_salts([body.cache_salt], role="engine")
                missing = [name for name in required if not getattr(body, name)]
                if missing:
                    raise Unprocessable(f"missing required field(s): {', '.join(missing)}")
                return await handler(context, body, call.who)
            except KvatlasError:
                raise
            except ValueError as exc:  # a field the node could not make sense of
                raise Unprocessable(str(exc)) from None

        return route

    return wrap


def tracker_for(context: Context, call: EngineCall, who: Principal) -> tuple[RequestTracker, str]:
    """The call's tracker (``who`` may use its salt: checked by :func:`engine_call`)."""
    node, config = context.node, context.node.config
    if len(call.tokens) // 4 > config.max_query_tokens:
        raise PayloadTooLarge(
            f"{len(call.tokens) // 4} tokens exceed --max-query-tokens {config.max_query_tokens}"
        )
    tokens = np.frombuffer(call.tokens, dtype="<u4")
    identity = Identity(
        tokens, tuple((i.identifier, i.offset, i.length) for i in call.mm_items), call.cache_salt
    )

    def make() -> RequestTracker:
        items = [MMItem.of(i.identifier, i.offset, i.length) for i in call.mm_items]
        return node.tracker(
            token_ids=tokens, mm_items=items, cache_salt=call.cache_salt,
            request_id=call.request_id,
        )  # fmt: skip

    return context.trackers.get_or_create(who, call.request_id, identity, make)


def _short_store(tracker: RequestTracker, call: EngineCall, chunk_size: int) -> str:
    """Why a store kept fewer chunks than it sent (a reply field, only then)."""
    if not tracker.cacheable:
        return "the request has no cacheable key (a multimodal item without a usable identity)"
    tokens = len(call.tokens) // 4
    full = tokens // chunk_size
    if call.first_chunk + call.n_chunks <= full:  # every chunk sent was whole
        return (
            "no tier could keep some chunks: L1 is full of pinned or held chunks (or smaller "
            "than a chunk) and no L2 took them (counted: l1_refused_pinned, l1_rejected)"
        )
    return (
        f"only full chunks are stored: {tokens} tokens hold {full} full chunk(s) of "
        f"{chunk_size}, and chunks {call.first_chunk}..{call.first_chunk + call.n_chunks - 1} "
        "were sent"
    )


@engine_call()
async def store(context: Context, call: EngineCall, who: Principal) -> StoreReply:
    """Store the KV of a request's chunks: `tokens`, `kv` (`n_chunks` chunks in the node's
    layout from chunk `first_chunk`), `cache_salt`, `mm_items`. Reply `{stored, cacheable}`."""
    node, layout = context.node, context.node.layout
    tracker, _ = tracker_for(context, call, who)
    if len(call.kv) != call.n_chunks * layout.chunk_bytes:
        raise Unprocessable(
            f"kv bytes do not match n_chunks x the node's KV layout: {len(call.kv)} bytes, "
            f"expected {call.n_chunks} x {layout.chunk_bytes} (GET /engine/layout)"
        )
    kv = np.frombuffer(call.kv, dtype=layout.numpy_dtype())
    chunks = list(kv.reshape((call.n_chunks, *layout.shape)))
    stored = await run_in_threadpool(node.store, tracker, chunks, first_chunk=call.first_chunk)
    context.trackers.drop(who, call.request_id, tracker)
    reply = StoreReply(stored=stored, cacheable=tracker.cacheable)
    if stored < call.n_chunks:
        reply.reason = _short_store(tracker, call, layout.chunk_size)
    return reply


@engine_call()
async def lookup(context: Context, call: EngineCall, who: Principal) -> HitReply:
    """Prefix lookup: how many leading tokens of `tokens` a tier or a peer holds. Reply
    `{hit_tokens, cacheable}`."""
    tracker, _ = tracker_for(context, call, who)
    hit = await run_in_threadpool(context.node.lookup, tracker)
    return HitReply(hit, tracker.cacheable)


@engine_call()
async def retrieve(context: Context, call: EngineCall, who: Principal) -> RetrieveReply:
    """Prefix retrieval: the KV of the leading chunks held anywhere, from chunk `first_chunk`
    (the caller holds those before it). Reply `{hit_tokens, kv, sources}` (`kv`: the chunks
    in the node's layout, back to back)."""
    tracker, _ = tracker_for(context, call, who)
    got = await run_in_threadpool(context.node.retrieve, tracker, first_chunk=call.first_chunk)
    context.trackers.drop(who, call.request_id, tracker)
    kv = b"".join(np.ascontiguousarray(k).tobytes() for k in got.kv)
    return RetrieveReply(got.hit_tokens, kv, dict(got.sources))


@engine_call(BLEND_REQUIRED)
async def blend_lookup(context: Context, call: EngineCall, who: Principal) -> BlendLookupReply:
    """Blend lookup: cached chunks anywhere in `tokens` after `prefix_len`. Reply `{pending:
    true}` (poll again with the same `request_id`) or `{pending: false, segments,
    local_matches, fleet_matches, fleet_used}`."""
    tracker, blend_id = tracker_for(context, call, who)
    result = await run_in_threadpool(
        context.node.blend_lookup, tracker, prefix_len=call.prefix_len, request_id=blend_id
    )
    if result is None:
        return BlendLookupReply(pending=True)
    return BlendLookupReply(
        pending=False,
        segments=[segment_to_wire(s) for s in result.segments],
        local_matches=result.local_matches,
        fleet_matches=result.fleet_matches,
        fleet_used=result.fleet_used,
    )


def _part(seg: Segment, kv: Any) -> BlendPart:
    """A retrieved segment with its KV."""
    fields = msgspec.structs.asdict(segment_to_wire(seg))
    return BlendPart(**fields, kv=np.ascontiguousarray(kv).tobytes())


@engine_call(BLEND_REQUIRED)
async def blend_retrieve(context: Context, call: EngineCall, who: Principal) -> BlendRetrieveReply:
    """Blend retrieval of `segments` (from a blend lookup): KV re-RoPE'd to each segment's
    `cur_st`. Reply `{parts: [segment + kv], misses, sources}`."""
    segments = []
    for i, wire in enumerate(call.segments):
        try:
            segments.append(segment_of(wire))
        except ValueError as exc:
            raise Unprocessable(f"segments[{i}]: {exc}") from None
    tracker, blend_id = tracker_for(context, call, who)
    got = await run_in_threadpool(context.node.blend_retrieve, tracker, segments)
    context.trackers.drop(who, call.request_id, tracker)
    context.node.blend.cancel(blend_id)  # a lookup never polled to its end is not kept to its TTL
    return BlendRetrieveReply(
        [_part(seg, kv) for seg, kv in got.parts],
        [segment_to_wire(s) for s in got.misses],
        dict(got.sources),
    )
