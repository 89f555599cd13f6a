"""Usage routes (LMCache's shape): per instance and per shared pool, the capacity declared by
config batches beside the bytes its placements hold. See docs/coordinator.md ("API").
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvatlas.coordinator.routes.deps import Caller, Service
from kvatlas.coordinator.usage import fleet_usage as fleet_usage_of
from kvatlas.coordinator.usage import instance_usage as instance_usage_of
from kvatlas.coordinator.usage import instance_usage_to_wire, usage_to_wire
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()


@router.get("/instances/usage", summary="Capacity and used bytes of every instance and pool")
async def fleet_usage(service: Service, who: Caller) -> Response:
    who.require("lookup", "emit")
    return MsgspecJSONResponse(
        usage_to_wire(await run_in_threadpool(fleet_usage_of, service.directory, service.instances))
    )


@router.get("/instances/{instance_id}/usage", summary="Capacity and used bytes of one instance")
async def instance_usage(instance_id: str, service: Service, who: Caller) -> Response:
    who.require("lookup", "emit")
    usage = await run_in_threadpool(
        instance_usage_of, service.directory, service.instances, instance_id
    )
    return MsgspecJSONResponse(instance_usage_to_wire(usage))
