"""``POST /route/score``: rank instances for a query by the prefix each can load and the
fragments each can fetch, weighted by tier (``coordinator/route_score.py`` answers it; see
docs/route-scoring.md). The body is JSON, or msgpack (``RouteScorePacked``: the tokens as
little-endian uint32 bytes); the reply is JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from kvatlas.coordinator.routes.context import Context
from kvatlas.routing import Call, Reply

ROUTE_SCORE_DOCS: dict[str, Any] = {
    "requestBody": {
        "content": {
            "application/msgpack": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "a map: the JSON body's fields, with `tokens` (the query's "
                    "token ids as little-endian uint32 bytes) in place of `tokens_b64` / "
                    "`token_ids`",
                }
            }
        }
    }
}
"""``POST /route/score``'s msgpack body in ``/openapi.json`` (beside the JSON one)."""


def route_score(ctx: Context, call: Call[None, None]) -> Awaitable[Reply]:
    return ctx.scoring.handle(call)
