"""The operator's routes: the status page (``GET /``, ``GET /status``), its body
(``GET /status/fragment``) and data (``GET /status.json``), and the nodes' value reports
(``PUT /instances/{id}/report``). See docs/operator.md and docs/security.md.

With auth on, the page is an open shell that shows no data: its script asks for a token and
fetches the body with it; the body and the JSON need what ``/metrics`` needs (their entries in ``routes.ROUTES``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.concurrency import run_in_threadpool

from kvatlas.api import ReportReply
from kvatlas.coordinator.node_reports import NodeReport
from kvatlas.coordinator.routes.context import Context
from kvatlas.coordinator.status import status_to_wire
from kvatlas.coordinator.status_page import page, render_body
from kvatlas.errors import NotFound, Unprocessable
from kvatlas.routing import Call, Reply
from kvatlas.web import json_encoder

_NO_STORE = (b"cache-control", b"no-store")
_HTML = "text/html; charset=utf-8"


def _html(text: str, csp: str | None = None) -> Reply:
    headers = (_NO_STORE, *(((b"content-security-policy", csp.encode()),) if csp else ()))
    return Reply(text.encode(), headers=headers, media_type=_HTML)


async def status_page(ctx: Context, call: Call[None, None]) -> Reply:
    service = ctx.service
    if service.auth is not None:  # the open shell: no data without a token
        return _html(*page(None))
    body = render_body(await run_in_threadpool(service.status.view))
    return _html(*page(body))


async def status_fragment(ctx: Context, call: Call[None, None]) -> Reply:
    # the page's script inserts it (no CSP of its own applies there); opened as a document of
    # its own, nothing in it may run or load
    body = render_body(await run_in_threadpool(ctx.service.status.view))
    return _html(body, "default-src 'none'; style-src 'unsafe-inline'")


async def status_json(ctx: Context, call: Call[None, None]) -> Reply:
    view: Any = await run_in_threadpool(ctx.service.status.view)
    return Reply(json_encoder.encode(status_to_wire(view)), headers=(_NO_STORE,))


async def report(ctx: Context, call: Call[None, None]) -> ReportReply:
    instance_id, service = call.params["instance_id"], ctx.service
    call.who.require_instance(instance_id)
    try:
        body = msgspec.json.decode(call.raw)
    except msgspec.DecodeError as exc:
        raise Unprocessable(f"report: not JSON ({exc})") from None
    parsed = NodeReport.from_wire(body)
    if not service.instances.known(instance_id):
        raise NotFound("unknown instance; re-register")
    carried = service.instances.carried_over(instance_id)
    service.status.reports.accept(instance_id, parsed, carried_over=carried)
    return ReportReply(instance_id=instance_id)
