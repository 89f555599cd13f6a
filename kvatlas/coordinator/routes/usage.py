"""Usage routes (LMCache's shape): per instance and per shared pool, the capacity declared by
config batches beside the bytes its placements hold. See docs/coordinator.md ("API").
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from kvatlas.api import FleetUsageReply, InstanceUsageReply
from kvatlas.coordinator.routes.context import Context
from kvatlas.coordinator.usage import fleet_usage as fleet_usage_of
from kvatlas.coordinator.usage import instance_usage as instance_usage_of
from kvatlas.coordinator.usage import instance_usage_to_wire, usage_to_wire
from kvatlas.errors import NotFound
from kvatlas.routing import Call


async def fleet_usage(ctx: Context, call: Call[None, None]) -> FleetUsageReply:
    service = ctx.service
    return usage_to_wire(
        await run_in_threadpool(fleet_usage_of, service.directory, service.instances)
    )


async def instance_usage(ctx: Context, call: Call[None, None]) -> InstanceUsageReply:
    service = ctx.service
    instance_id = call.params["instance_id"]
    usage = await run_in_threadpool(
        instance_usage_of, service.directory, service.instances, instance_id
    )
    if not (usage.registered or usage.declared_capacity or usage.modules):
        raise NotFound(f"unknown instance {instance_id!r}")  # (as LMCache answers it)
    return instance_usage_to_wire(usage)
