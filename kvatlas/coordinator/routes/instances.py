"""Instance routes: register, heartbeat, deregister (fences L1, forgets the cursor) and the
listing with liveness, cursors, gaps and lag (scoped to the caller's tenants when its token is
bound to cache salts). See docs/coordinator.md and docs/security.md.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from kvatlas.api import HeartbeatReply, InstancesReply, RegisteredReply, RegisterRequest
from kvatlas.coordinator.ingestion import refuse_engine_ids
from kvatlas.coordinator.registration import registration
from kvatlas.coordinator.routes.context import Context
from kvatlas.coordinator.wire import heartbeat_to_wire, instances_to_wire, registered_to_wire
from kvatlas.errors import NotFound
from kvatlas.routing import Call, Reply

NO_CONTENT = Reply(status=204, media_type=None)


async def register(ctx: Context, call: Call[RegisterRequest, None]) -> RegisteredReply:
    service, who, body = ctx.service, call.who, call.body
    who.require_instance(body.instance_id)  # the id is in the body
    asked, fields = registration(body)
    service.check_chunk_size(body.chunk_size)
    refuse_engine_ids([asked] if asked else [], service.kv_events.is_engine)
    salts = None if who.is_admin else who.cache_salts
    instance_id, again = service.instances.register(asked, fields, salts)
    # its pending cache-control commands: now (in a worker thread: they may be in Redis)
    await run_in_threadpool(service.delivery.instance_back, instance_id)
    return registered_to_wire(instance_id, again)


async def heartbeat(ctx: Context, call: Call[None, None]) -> HeartbeatReply:
    instance_id, service = call.params["instance_id"], ctx.service
    call.who.require_instance(instance_id)
    if not service.instances.heartbeat(instance_id):
        raise NotFound("unknown instance; re-register")
    return heartbeat_to_wire(
        instance_id,
        resync=service.wants_digest(instance_id),
        list_all=service.instances.take_listing(instance_id),
    )


async def deregister(ctx: Context, call: Call[None, None]) -> Reply:
    instance_id = call.params["instance_id"]
    call.who.require_instance(instance_id)
    await run_in_threadpool(ctx.service.deregister, instance_id)
    return NO_CONTENT


async def instances(ctx: Context, call: Call[None, None]) -> InstancesReply:
    return instances_to_wire(ctx.service.instances_view(call.who))
