"""Instance routes: register, heartbeat, deregister (fences L1, forgets the cursor) and the
listing with liveness, cursors, gaps and lag (scoped to the caller's tenants when its token is
bound to cache salts). See docs/coordinator.md and docs/security.md.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvatlas.coordinator.ingestion import refuse_engine_ids
from kvatlas.coordinator.registration import registration
from kvatlas.coordinator.routes.deps import Caller, Service
from kvatlas.coordinator.schemas import RegisterRequest
from kvatlas.coordinator.wire import heartbeat_to_wire, instances_to_wire, registered_to_wire
from kvatlas.errors import NotFound
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()


@router.post("/instances", summary="Register an instance")
async def register(body: RegisterRequest, service: Service, who: Caller) -> Response:
    who.require_instance(body.instance_id)
    asked, fields = registration(body)
    service.check_chunk_size(body.chunk_size)
    refuse_engine_ids([asked] if asked else [], service.kv_events.is_engine)
    salts = None if who.is_admin else who.cache_salts
    instance_id, again = service.instances.register(asked, fields, salts)
    return MsgspecJSONResponse(registered_to_wire(instance_id, again))


@router.put("/instances/{instance_id}/heartbeat", summary="Heartbeat")
async def heartbeat(instance_id: str, service: Service, who: Caller) -> Response:
    who.require_instance(instance_id)
    if not service.instances.heartbeat(instance_id):
        raise NotFound("unknown instance; re-register")
    return MsgspecJSONResponse(
        heartbeat_to_wire(instance_id, resync=service.wants_digest(instance_id))
    )


@router.delete(
    "/instances/{instance_id}",
    status_code=204,
    summary="Deregister: fence L1, forget the cursor (204, also for an unknown id)",
)
async def deregister(instance_id: str, service: Service, who: Caller) -> Response:
    who.require_instance(instance_id)
    await run_in_threadpool(service.deregister, instance_id)
    return Response(status_code=204)


@router.get("/instances", summary="Instances with liveness, cursors, gaps and lag")
async def instances(service: Service, who: Caller) -> Response:
    who.require("lookup", "emit")
    return MsgspecJSONResponse(instances_to_wire(service.instances_view(who)))
