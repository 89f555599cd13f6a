"""``PUT /config/chunk-size`` (LMCache 0.5.7): an instance states its chunk size; 409 when it
is not the coordinator's ``--chunk-size`` (its keys would never match). See
docs/coordinator.md ("API").
"""

from __future__ import annotations

from kvatlas.api import ChunkSizeReply, ChunkSizeRequest
from kvatlas.coordinator.routes.context import Context
from kvatlas.errors import Unprocessable
from kvatlas.routing import Call


async def chunk_size(ctx: Context, call: Call[ChunkSizeRequest, None]) -> ChunkSizeReply:
    asked = call.body.chunk_size
    if asked < 1:
        raise Unprocessable(f"chunk_size must be >= 1, got {asked}")
    ctx.service.check_chunk_size(asked)
    return ChunkSizeReply(chunk_size=ctx.service.config.chunk_size)
