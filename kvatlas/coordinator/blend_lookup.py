"""``POST /directory/blend-lookup`` from body bytes to reply bytes, in one function that both
the ASGI fast path (``asgi.py``) and the documented route call: same checks in the same
order, same errors, same reply. It runs on the match pool, never on the event loop: decoding,
matching and encoding scale with the query. See docs/coordinator.md ("API") and
docs/blend-index.md.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from urllib.parse import parse_qs

from kvatlas.auth import Principal
from kvatlas.coordinator.query import blend_query, decode_blend_body
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.wire import blend_to_wire
from kvatlas.web import json_encoder

WITH_PLACEMENTS = "with_placements"
"""Query parameter: ``true`` (or ``1``) adds the holders of each match to the reply."""


def wants_placements(query_string: bytes) -> bool:
    """Whether a blend lookup's query string asks for ``with_placements``."""
    if not query_string:  # the default request: no parsing at all
        return False
    values = parse_qs(query_string.decode("latin-1")).get(WITH_PLACEMENTS, [])
    return any(v.lower() in ("true", "1") for v in values)


BLEND_HEADER = "x-kvatlas-blend"
"""Reply header: ``enabled`` or ``disabled`` (whether this coordinator indexes content)."""


def blend_header_value(enabled: bool) -> str:
    return "enabled" if enabled else "disabled"


BLEND_HEADERS: dict[bool, tuple[bytes, bytes]] = {
    on: (BLEND_HEADER.encode(), blend_header_value(on).encode()) for on in (False, True)
}
"""The header as raw ASGI bytes, built once (the fast path sends it on every reply)."""


class BlendLookup:
    """Answers blend lookups for ``service`` on ``pool`` (sized to the cores by the app)."""

    def __init__(self, service: CoordinatorService, pool: Executor) -> None:
        self.service = service
        self.pool = pool

    async def __call__(
        self, raw: bytes, who: Principal, with_placements: bool = False
    ) -> tuple[bytes, bool]:
        """The reply body and whether blend lookup is enabled, answered on the match pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.answer, raw, who, with_placements)

    def answer(
        self, raw: bytes, who: Principal, with_placements: bool = False
    ) -> tuple[bytes, bool]:
        started = time.perf_counter()
        service = self.service
        body = decode_blend_body(raw)
        who.require_salts({body.cache_salt})
        query = blend_query(body, service.config.max_query_tokens)
        enabled = service.directory.blend_enabled
        if query is None:
            return json_encoder.encode(blend_to_wire([], enabled)), enabled
        matches = service.directory.blend_match(query.tokens, query.namespace)
        held = (
            service.directory.match_placements(matches, query.namespace)
            if with_placements
            else None
        )
        reply = json_encoder.encode(blend_to_wire(matches, enabled, held))
        service.metrics.blend_latency.observe(time.perf_counter() - started)
        service.metrics.blend_matches.inc(len(matches))
        return reply, enabled
