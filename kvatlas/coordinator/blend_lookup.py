"""``POST /directory/blend-lookup`` from body bytes to reply bytes (:meth:`BlendLookup.handle`,
the route's handler). See docs/coordinator.md ("API") and docs/blend-index.md.

Where it runs: a query whose body is at most :data:`INLINE_BODY_BYTES` is answered on the event
loop, a larger one on the match pool. The hop to a pool thread and back (a futex wake, the
loop's wake-up, GIL hand-overs) costs as much server CPU as decoding the whole
body, while what it buys — the event loop going on during the compiled (GIL-free) parts — is
bounded by the same size: see :data:`INLINE_BODY_BYTES`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from urllib.parse import parse_qs

from kvatlas.auth import Principal
from kvatlas.coordinator._blend_reply import blend_reply
from kvatlas.coordinator.query import blend_query, decode_blend_lookup
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.wire import blend_to_wire
from kvatlas.directory import MatchColumns
from kvatlas.errors import Unprocessable
from kvatlas.routing import Call, Reply
from kvatlas.web import json_encoder

WITH_PLACEMENTS = "with_placements"
"""Query parameter: ``true`` (or ``1``) adds the holders of each match to the reply; ``false``
(or ``0``) does not; any other value, or the parameter given twice, is refused (422)."""
INLINE_BODY_BYTES = 256 * 1024
"""Bodies up to this size (a query of up to ≈49k tokens in ``tokens_b64``) are answered on the
event loop: their work (docs/performance.md, `bench service`) stays within the GIL switch
interval, for which a pool thread's Python may hold the loop anyway (``runtime``). Longer
queries (up to ``--max-query-tokens``) go to the match pool, so one never stalls the loop."""


def wants_placements(query_string: bytes) -> bool:
    """Whether a blend lookup's query string asks for ``with_placements``."""
    if not query_string:  # the default request: no parsing at all
        return False
    values = parse_qs(query_string.decode("latin-1"), keep_blank_values=True)
    given = values.get(WITH_PLACEMENTS, ())
    if len(given) > 1:  # "true&...=false": which one?
        raise Unprocessable(f"{WITH_PLACEMENTS} given {len(given)} times: give it once")
    asked = {v.lower() for v in given}
    if not asked <= {"true", "1", "false", "0"}:
        raise Unprocessable(f"{WITH_PLACEMENTS} must be true or false (or 1, 0)")
    return bool(asked & {"true", "1"})


BLEND_HEADER = "x-kvatlas-blend"
"""Reply header: ``enabled`` or ``disabled`` (whether this coordinator indexes content)."""
BLEND_HEADERS: dict[bool, tuple[bytes, bytes]] = {
    on: (BLEND_HEADER.encode(), b"enabled" if on else b"disabled") for on in (False, True)
}
"""The header as raw ASGI bytes, built once (sent on every reply)."""


class BlendLookup:
    """Answers blend lookups for ``service``; long queries on ``pool`` (sized to the cores by
    the app)."""

    def __init__(self, service: CoordinatorService, pool: Executor) -> None:
        self.service = service
        self.pool = pool

    def in_turn(self, call: Call[None, None]) -> Reply | None:
        """The reply, on the event loop, to a body of at most :data:`INLINE_BODY_BYTES`; else
        ``None``."""
        if len(call.raw) > INLINE_BODY_BYTES:
            return None
        placements = wants_placements(call.scope.get("query_string", b""))
        payload, enabled = self.answer(call.raw, call.who, placements)
        return Reply(payload, headers=(BLEND_HEADERS[enabled],))

    async def handle(self, call: Call[None, None]) -> Reply:
        """The route's handler: :meth:`in_turn`'s reply, else the one from the pool."""
        reply = self.in_turn(call)
        if reply is not None:
            return reply
        placements = wants_placements(call.scope.get("query_string", b""))
        loop = asyncio.get_running_loop()
        payload, enabled = await loop.run_in_executor(
            self.pool, self.answer, call.raw, call.who, placements
        )
        return Reply(payload, headers=(BLEND_HEADERS[enabled],))

    def answer(
        self, raw: bytes, who: Principal, with_placements: bool = False
    ) -> tuple[bytes, bool]:
        started = time.perf_counter()
        service = self.service
        max_tokens = service.config.max_query_tokens
        body, decoded_b64 = decode_blend_lookup(raw, max_tokens)
        who.require_salts({body.cache_salt})
        query = blend_query(body, max_tokens, decoded_b64)
        index = service.directory.blend_index
        enabled = index is not None
        if query is None:
            return json_encoder.encode(blend_to_wire([], enabled)), enabled
        if index is None:
            columns = MatchColumns.empty()
        else:
            columns = service.directory.chunk_matches(
                index.match_columns(query.tokens, query.namespace)
            )
        if with_placements:
            matches = columns.matches()
            held = service.directory.match_placements(matches, query.namespace)
            reply = json_encoder.encode(blend_to_wire(matches, enabled, held))
        else:  # the common reply, written from the columns (no object per match)
            reply = blend_reply(columns, enabled)
        service.metrics.blend_latency.observe(time.perf_counter() - started)
        service.metrics.blend_matches.inc(columns.n_matches)
        return reply, enabled
