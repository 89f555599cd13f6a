"""The node's read-only routes: its KV layout, stats, inventory, Prometheus metrics and
liveness."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from kvatlas.api import KeyRow
from kvatlas.api.engine import EngineLayout, InventoryReply, InventoryRow, NodeHealthReply
from kvatlas.node.routes.context import Context
from kvatlas.routing import Call, Reply


async def engine_layout(context: Context, call: Call[None, None]) -> EngineLayout:
    """The node's KV layout and key scheme (what EngineClient reads)."""
    return context.layout


async def stats(context: Context, call: Call[None, None]) -> dict[str, Any]:
    """The node's figures, its counters flat beside them, and the held trackers'."""
    return {**context.node.stats().to_wire(), "trackers": asdict(context.trackers.stats())}


async def inventory(context: Context, call: Call[None, None]) -> InventoryReply:
    """What the node's own tiers hold (``CacheNode.held``), for operators and the soak."""
    node = context.node
    held = await run_in_threadpool(node.held)
    rows = [InventoryRow(KeyRow(**p.key.to_wire()), p.tier, p.backend) for p in held]
    return InventoryReply(node.instance_id, rows)


async def metrics(context: Context, call: Call[None, None]) -> Reply:
    data = await run_in_threadpool(generate_latest, context.node.timings.registry)
    return Reply(data, media_type=CONTENT_TYPE_LATEST)


async def healthz(context: Context, call: Call[None, None]) -> NodeHealthReply:
    """JSON, or msgpack when the caller asks for it (``Accept``)."""
    node = context.node
    return NodeHealthReply("ok", node.instance_id, **node.scheme.describe())
