"""``POST /route/score``: rank instances for a query by the prefix each can load and the
fragments each can fetch, weighted by tier (``coordinator/route_score.py`` answers it; see
docs/route-scoring.md).
"""

from __future__ import annotations

from collections.abc import Awaitable

from kvatlas.coordinator.routes.context import Context
from kvatlas.routing import Call, Reply


def route_score(ctx: Context, call: Call[None, None]) -> Awaitable[Reply]:
    return ctx.scoring.handle(call)
