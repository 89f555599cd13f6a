"""The operator's routes: the status page (``GET /``, ``GET /status``), its body
(``GET /status/fragment``) and data (``GET /status.json``), and the nodes' value reports
(``PUT /instances/{id}/report``). See docs/operator.md and docs/security.md.

With auth on, the page is an open shell that shows no data: its script asks for a token and
fetches the body with it; the body and the JSON need what ``/metrics`` needs (``asgi.py``).
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from kvatlas.coordinator.node_reports import NodeReport
from kvatlas.coordinator.routes.deps import Caller, Service
from kvatlas.coordinator.status import status_to_wire
from kvatlas.coordinator.status_page import page, render_body
from kvatlas.errors import NotFound, Unprocessable
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()

_NO_STORE = {"cache-control": "no-store"}


def _html(text: str, csp: str | None = None) -> HTMLResponse:
    headers = dict(_NO_STORE, **({"content-security-policy": csp} if csp else {}))
    return HTMLResponse(text, headers=headers)


@router.get("/", include_in_schema=False)
@router.get("/status", include_in_schema=False)
async def status_page(service: Service) -> Response:
    if service.auth is not None:  # the open shell: no data without a token
        return _html(*page(None))
    body = render_body(await run_in_threadpool(service.status.view))
    return _html(*page(body))


@router.get("/status/fragment", include_in_schema=False)
async def status_fragment(service: Service) -> Response:
    return _html(render_body(await run_in_threadpool(service.status.view)))


@router.get("/status.json", summary="Everything the status page shows, as JSON")
async def status_json(service: Service) -> Response:
    view = await run_in_threadpool(service.status.view)
    return MsgspecJSONResponse(status_to_wire(view), headers=_NO_STORE)


@router.put("/instances/{instance_id}/report", summary="A node's value counters and tiers")
async def report(instance_id: str, request: Request, service: Service, who: Caller) -> Response:
    who.require_instance(instance_id)
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise Unprocessable(f"report: not JSON ({exc})") from None
    parsed = NodeReport.from_wire(body)
    if not service.instances.known(instance_id):
        raise NotFound("unknown instance; re-register")
    service.status.reports.accept(instance_id, parsed)
    return MsgspecJSONResponse({"instance_id": instance_id, "ok": True})
