"""``PUT /config/chunk-size`` (LMCache 0.5.7): an instance states its chunk size; 409 when it
is not the coordinator's ``--chunk-size`` (its keys would never match). See
docs/coordinator.md ("API").
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from kvatlas.coordinator.routes.deps import Caller, Service
from kvatlas.coordinator.schemas import ChunkSizeRequest
from kvatlas.errors import Unprocessable
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()


@router.put("/config/chunk-size", summary="Check an instance's chunk size (409 if not ours)")
async def chunk_size(body: ChunkSizeRequest, service: Service, who: Caller) -> Response:
    who.require("emit")
    if body.chunk_size < 1:
        raise Unprocessable(f"chunk_size must be >= 1, got {body.chunk_size}")
    service.check_chunk_size(body.chunk_size)
    return MsgspecJSONResponse(chunk_size_to_wire(service.config.chunk_size))


def chunk_size_to_wire(chunk_size: int) -> dict[str, Any]:
    """``PUT /config/chunk-size``: the fleet's chunk size (the one the coordinator has)."""
    return {"chunk_size": chunk_size}


# ---------------------------------------------------------------------------- events, health
