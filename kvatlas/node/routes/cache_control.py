"""LMCache 0.5.6's MP-server routes (``lmcache server``) over :class:`~kvatlas.node.
cache_control.NodeCacheControl`, JSON in and out, the same status codes: 422 a body that is not
of its type, 400/404/503 what the control refuses (``detail`` says why), 202 a submitted
prefetch (``docs/cache-control.md``). A key given twice in one object of a body (``"tier"``
twice: which delete was meant?) is a 422 naming it, as on the coordinator's control routes.
The work runs in worker threads."""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec
from starlette.concurrency import run_in_threadpool

from kvatlas.api import decode
from kvatlas.api.cache_control import (
    ClearBody,
    ClearReply,
    DeleteObjectsBody,
    DeleteObjectsReply,
    HoldBody,
    HoldReply,
    ObjectPage,
    ObjectsQuery,
    PrefetchBody,
    PrefetchStatusReply,
    PrefetchSubmitted,
    ReleaseReply,
)
from kvatlas.fields import check_unique_keys
from kvatlas.node.routes.context import Context
from kvatlas.routing import Call

CACHE_CONTROL_MAX_BYTES: Final = 12 << 20
"""A cache-control body: 1,000,000 token ids or 10,000 keys in JSON fit (413 beyond)."""

S = TypeVar("S", bound=msgspec.Struct)


def _body(raw: bytes, type_: type[S]) -> S:
    """``raw`` as a ``type_`` (422 naming the field), each key given once."""
    body = decode(raw, type_)
    check_unique_keys(raw)
    return body


def json_body(type_: type[msgspec.Struct], required: bool = True) -> dict[str, object]:
    """The OpenAPI request body of a route that decodes its body itself: the Struct's own
    schema."""
    schema = msgspec.json.schema(type_)
    return {
        "requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}
    }


async def delete_objects(context: Context, call: Call[None, None]) -> DeleteObjectsReply:
    body = _body(call.raw, DeleteObjectsBody)
    return await run_in_threadpool(context.cache_control.delete_objects, body)


async def submit_prefetch(context: Context, call: Call[None, None]) -> PrefetchSubmitted:
    body = _body(call.raw, PrefetchBody)
    return await run_in_threadpool(context.cache_control.submit_prefetch, body)


async def prefetch_status(context: Context, call: Call[None, None]) -> PrefetchStatusReply:
    request_id = call.params["request_id"]
    return await run_in_threadpool(context.cache_control.prefetch_status, request_id)


async def list_objects(context: Context, call: Call[None, ObjectsQuery]) -> ObjectPage:
    q = call.query
    return await run_in_threadpool(
        context.cache_control.list_objects, q.tier, q.adapter, q.model_name, q.page_size,
        q.page_token,
    )  # fmt: skip


async def clear(context: Context, call: Call[None, None]) -> ClearReply:
    body = _body(call.raw, ClearBody) if call.raw.strip() else ClearBody()
    return await run_in_threadpool(context.cache_control.clear, body)


async def hold(context: Context, call: Call[None, None]) -> HoldReply:
    body = _body(call.raw, HoldBody)
    return await run_in_threadpool(context.cache_control.hold, call.params["hold_id"], body)


async def release(context: Context, call: Call[None, None]) -> ReleaseReply:
    return await run_in_threadpool(context.cache_control.release, call.params["hold_id"])
