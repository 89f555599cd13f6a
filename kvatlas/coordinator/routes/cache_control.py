"""Cache-control routes (LMCache 0.5.7's coordinator paths and fields; ``docs/cache-control.md``):
pins, delete, prefetch and its status, moves and their status, quotas. Each handler checks the
caller's salts, then calls :class:`~kvatlas.coordinator.cache_control.CacheControl`.

Who may: ``admin``, or a ``cache`` token bound to the salts it acts on (403 otherwise, before
anything is recorded); what covers every tenant (the default quota, the quota listing, pins of
every salt, a prefetch this coordinator did not record) needs a token not bound to salts.

A delete or prefetch is a durable command: the route tries one delivery at once and answers as
LMCache does (502 when the MP server cannot be reached), and the command is retried by the
delivery loop until it is done (``cache_control/delivery.py``); a prefetch's 502 carries its
``request_id`` beside LMCache's ``detail``, so its status can be polled all the same. The
handlers call cache control in a worker thread: with the Redis transport it reads and writes
Redis, which must not hold up the event loop.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from kvatlas.api.cache_control import (
    CoordinatorDeleteBody,
    CoordinatorDeleteReply,
    CoordinatorPrefetchBody,
    CoordinatorPrefetchReply,
    CoordinatorPrefetchStatus,
    MoveBody,
    MoveReply,
    MoveStatus,
    NodePinsQuery,
    PinReply,
    PinsQuery,
    PinsReply,
    QuotaConfig,
    QuotaList,
    QuotaSetBody,
    QuotaSetReply,
    QuotaStatus,
    TokenFields,
)
from kvatlas.auth import Principal
from kvatlas.coordinator.cache_control import Command, salt_of_path
from kvatlas.coordinator.routes.context import Context
from kvatlas.errors import BadGateway, Forbidden, InvalidInput, NotFound, Unavailable
from kvatlas.routing import Call

ROLE = "cache"


def _may(who: Principal, *salts: str) -> None:
    who.require_salts(salts, ROLE)


def _path_salt(segment: str) -> str:
    try:
        return salt_of_path(segment)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _foreign(who: Principal, command: Command | None) -> bool:
    """Whether ``command`` acts in a salt outside ``who``'s binding: its status is then
    answered as an unknown id's (a refusal naming the salt would tell another tenant's salt,
    and that the id is one, to whoever holds the id)."""
    return command is not None and bool(who.foreign_salts(k.cache_salt for k in command.keys))


# ------------------------------------------------------------------ pins


async def pin(ctx: Context, call: Call[TokenFields, None]) -> PinReply:
    _may(call.who, call.body.cache_salt)
    return await run_in_threadpool(ctx.service.cache_control.pin, call.body)


async def unpin(ctx: Context, call: Call[TokenFields, None]) -> PinReply:
    _may(call.who, call.body.cache_salt)
    return await run_in_threadpool(ctx.service.cache_control.unpin, call.body)


async def pins(ctx: Context, call: Call[None, PinsQuery]) -> PinsReply:
    q = call.query
    if not q.cache_salt and not call.who.sees_everything:
        raise Forbidden("pins of every salt: for a token not bound to cache_salts only")
    if q.cache_salt:
        _may(call.who, _path_salt(q.cache_salt))
    control = ctx.service.cache_control
    return await run_in_threadpool(control.list_pins, q.cache_salt, q.model_name, q.offset, q.limit)


async def node_pins(ctx: Context, call: Call[None, NodePinsQuery]) -> PinsReply:
    """A node reads its own pins (read-only, the node's ``emit`` token: its instance binding,
    and only the salts it is bound to), so that its LRU and L2 cap keep them."""
    call.who.require_instance(call.params["instance_id"])
    q, who = call.query, call.who
    salts = None if who.sees_everything else who.cache_salts
    control = ctx.service.cache_control
    return await run_in_threadpool(control.node_pins, salts, q.model_name, q.offset, q.limit)


# ------------------------------------------------------------------ delete, prefetch


async def delete(ctx: Context, call: Call[CoordinatorDeleteBody, None]) -> CoordinatorDeleteReply:
    body, service = call.body, ctx.service
    _may(call.who, body.cache_salt)
    outcome = await run_in_threadpool(service.cache_control.delete, body)
    if outcome.command is not None:
        failed = await run_in_threadpool(service.delivery.deliver, outcome.command)
        if failed is not None:  # recorded: the loop retries it
            raise BadGateway(f"delete to {body.instance_id!r} failed: {failed[0]}")
    return outcome.reply


async def prefetch(
    ctx: Context, call: Call[CoordinatorPrefetchBody, None]
) -> CoordinatorPrefetchReply:
    body, service = call.body, ctx.service
    _may(call.who, body.cache_salt)
    outcome = await run_in_threadpool(service.cache_control.prefetch, body)
    if outcome.command is not None:
        failed = await run_in_threadpool(service.delivery.deliver, outcome.command)
        if failed is not None:  # LMCache's 502; the command is kept: its id says where to look
            raise BadGateway(
                f"prefetch submit to {body.instance_id!r} failed: {failed[0]}",
                request_id=outcome.command.command_id,
            )
    return outcome.reply


async def prefetch_status(ctx: Context, call: Call[None, None]) -> CoordinatorPrefetchStatus:
    instance_id, request_id = call.params["instance_id"], call.params["request_id"]
    service = ctx.service
    control = service.cache_control
    command = await run_in_threadpool(control.commands.get, request_id)
    if not _foreign(call.who, command):
        status = await run_in_threadpool(control.prefetch_status, instance_id, request_id)
        if status is not None:
            return status
    if not call.who.sees_everything:
        raise Forbidden("a prefetch this coordinator did not record: for a token not bound to cache_salts only")  # fmt: skip
    url = service.delivery.fleet.url_of(instance_id)
    if url is None:
        raise BadGateway(f"prefetch status from {instance_id!r} failed: no http_port registered")

    def ask() -> CoordinatorPrefetchStatus | None:
        reply = service.delivery.call(url, lambda s: s.prefetch_status(request_id))
        if reply is None:
            return None
        return CoordinatorPrefetchStatus(reply.status, reply.found_keys, reply.total_keys)

    try:
        theirs = await run_in_threadpool(ask)
    except Unavailable as exc:
        raise BadGateway(f"prefetch status from {instance_id!r} failed: {exc}") from None
    if theirs is None:
        raise NotFound(f"unknown prefetch request_id={request_id}")
    return theirs


# ------------------------------------------------------------------ moves


async def move(ctx: Context, call: Call[MoveBody, None]) -> MoveReply:
    _may(call.who, call.body.cache_salt)
    reply, _command = await run_in_threadpool(ctx.service.cache_control.move, call.body)
    return reply


async def move_status(ctx: Context, call: Call[None, None]) -> MoveStatus:
    control = ctx.service.cache_control
    move_id = call.params["move_id"]
    command = await run_in_threadpool(control.commands.get, move_id)
    if _foreign(call.who, command):
        raise NotFound(f"unknown move_id={move_id!r}")  # as control.move_status answers it
    return await run_in_threadpool(control.move_status, move_id)


# ------------------------------------------------------------------ quotas


async def quota_config(ctx: Context, call: Call[None, None]) -> QuotaConfig:
    return await run_in_threadpool(ctx.service.cache_control.quota_config)


async def set_quota_config(ctx: Context, call: Call[QuotaConfig, None]) -> QuotaConfig:
    return await run_in_threadpool(ctx.service.cache_control.set_quota_config, call.body)


async def set_quota(ctx: Context, call: Call[QuotaSetBody, None]) -> QuotaSetReply:
    segment = call.params["cache_salt"]
    _may(call.who, _path_salt(segment))
    return await run_in_threadpool(ctx.service.cache_control.set_quota, segment, call.body)


async def remove_quota(ctx: Context, call: Call[None, None]) -> QuotaSetReply:
    segment = call.params["cache_salt"]
    _may(call.who, _path_salt(segment))
    return await run_in_threadpool(ctx.service.cache_control.remove_quota, segment)


async def quota(ctx: Context, call: Call[None, None]) -> QuotaStatus:
    segment = call.params["cache_salt"]
    _may(call.who, _path_salt(segment))
    control = ctx.service.cache_control
    return await run_in_threadpool(control.quota, segment)


async def quotas(ctx: Context, call: Call[None, None]) -> QuotaList:
    return await run_in_threadpool(ctx.service.cache_control.quotas_listed)
