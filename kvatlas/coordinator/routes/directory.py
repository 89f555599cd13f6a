"""The directory's routes: prefix lookup (by keys or by tokens), blend lookup, statistics and
the paginated key listing. See docs/coordinator.md and docs/directory.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from starlette.concurrency import run_in_threadpool

from kvatlas.api import KeyListingQuery, KeyPageReply
from kvatlas.coordinator._lookup_reply import json_id_lists
from kvatlas.coordinator.query import KeysQuery, decode_lookup_body, lookup_query
from kvatlas.coordinator.routes.context import Context
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.wire import key_page_to_wire, lookup_to_wire, stats_to_wire
from kvatlas.directory import KeyFilter
from kvatlas.errors import PayloadTooLarge, Unprocessable
from kvatlas.events import TIERS
from kvatlas.routing import JSON, Call, Reply


def lookup_in_turn(ctx: Context, call: Call[None, None]) -> Reply | None:
    """The reply, on the event loop, to a small body while the directory is free
    (``answers_on_loop``); else ``None``."""
    if not ctx.service.answers_on_loop(call.raw):
        return None
    started = time.perf_counter()
    form, reply = _lookup(ctx.service, call)
    ctx.service.metrics.lookup_latency.labels(form).observe(time.perf_counter() - started)
    return reply


async def lookup(ctx: Context, call: Call[None, None]) -> Reply:
    now = lookup_in_turn(ctx, call)
    if now is not None:
        return now
    # A body may be tens of MB (its route's limit): one not answered on the loop (over
    # service.INLINE_BODY_BYTES, or any while a change holds the directory) is parsed on the
    # lookup pool, never on the event loop, and sized up from its bytes before a token is
    # decoded; the reply (a 32k-token prompt's is ≈0.25 MB of JSON) is built and encoded
    # there too, in one hop. A pool as large as the cores, not a thread per request: with
    # eight lookups in flight, 15% less CPU a lookup than eight threads taking turns at the
    # GIL and the directory lock (docs/performance.md, "Directory: design figures").
    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    form, reply = await loop.run_in_executor(ctx.lookup_pool, _lookup, ctx.service, call)
    ctx.service.metrics.lookup_latency.labels(form).observe(time.perf_counter() - started)
    return reply


def _lookup(service: CoordinatorService, call: Call[None, None]) -> tuple[str, Reply]:
    """The lookup's form and its reply, from the body's bytes (on a worker thread)."""
    config = service.config
    body = decode_lookup_body(call.raw, config.max_query_tokens, config.max_lookup_keys)
    query = lookup_query(body, config.max_query_tokens, config.max_lookup_keys)
    call.who.require_salts(query.salts)
    # A reply's ids: at most what its keys' chunks hold at chunk_size each (the longest a
    # legitimate content is), which bounds a content bound longer than a chunk asked many times
    chunk = config.chunk_size
    try:
        if isinstance(query, KeysQuery):
            found = service.lookup_keys(query.keys, config.max_lookup_keys * chunk)
        else:
            found = service.directory.lookup_tokens(
                query.tokens, query.model_name, query.world_size, query.cache_salt,
                query.object_group_id, query.world_size * (len(query.tokens) // chunk) * chunk,
            )  # fmt: skip
    except PayloadTooLarge as exc:
        raise PayloadTooLarge(
            f"the reply would carry too many token ids: {exc}, what the chunks asked for hold "
            f"at {chunk} ids each (--max-query-tokens, --chunk-size); ask for fewer keys"
        ) from None
    codec = call.codec
    ids = json_id_lists([kp.content for kp in found.results]) if codec is JSON else None
    return query.form, Reply(codec.encode(lookup_to_wire(found, ids)), media_type=codec.media_type)


def blend_lookup(ctx: Context, call: Call[None, None]) -> Awaitable[Reply]:
    return ctx.blend.handle(call)  # the hottest route: no coroutine of its own


def blend_lookup_in_turn(ctx: Context, call: Call[None, None]) -> Reply | None:
    return ctx.blend.in_turn(call)


async def stats(ctx: Context, call: Call[None, None]) -> dict[str, Any]:
    # per-salt figures are not kept: the route's access needs a token that sees every tenant
    return stats_to_wire(await run_in_threadpool(ctx.service.stats))


async def list_keys(ctx: Context, call: Call[None, KeyListingQuery]) -> KeyPageReply:
    q, service = call.query, ctx.service
    tier = None if q.tier == "all" else q.tier  # LMCache's defaults: all, "" and "" take any
    if tier is not None and tier not in TIERS:  # (a filter no key could match)
        raise Unprocessable(f"tier: unknown tier {tier!r:.40} (all or one of {sorted(TIERS)})")
    where = KeyFilter(tier=tier, instance_id=q.instance_id or None, backend=q.backend or None)

    def page() -> KeyPageReply:
        return key_page_to_wire(
            service.page_keys(
                where,
                offset=q.offset,
                limit=q.limit,
                cursor=q.cursor,
            )
        )

    return await run_in_threadpool(page)
