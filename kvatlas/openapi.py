"""A route table's OpenAPI document, generated from the table itself: each route's path and
query parameters, its request body and its reply are the msgspec Structs the route decodes and
encodes (``msgspec.json.schema_components``), so the documentation is the decoder. Also the
pages that show it (``/docs``, ``/redoc``), served as routes of the same table
(:func:`docs_routes`; who may read them: :data:`kvatlas.auth.DOCS_PATHS`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from kvatlas.routing import Access, Call, Reply, Route

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"
_HTML = "text/html; charset=utf-8"


def operation_id(route: Route) -> str:
    """``<handler>_<path>_<method>``, as FastAPI names operations (stable for generated
    clients)."""
    name = getattr(route.handler, "__name__", "route")
    return re.sub(r"\W", "_", f"{name}{route.path}") + "_" + route.method.lower()


def document(title: str, version: str, description: str, routes: Iterable[Route]) -> dict[str, Any]:
    """The OpenAPI document of ``routes`` (hidden ones left out), in table order."""
    shown = [r for r in routes if not r.hidden]
    types = list(
        dict.fromkeys(t for r in shown for t in (r.request, r.query, r.reply) if _is_struct(t))
    )
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    by_type = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for route in shown:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(
            route, by_type, components
        )
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "description": description, "version": version},
        "paths": paths,
        "components": {"schemas": {n: components[n] for n in sorted(components)}},
    }


def _operation(
    route: Route, by_type: Mapping[Any, Any], components: Mapping[str, Any]
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "operationId": operation_id(route)}
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in route.params
    ]
    if route.query is not None:
        query = components[route.query.__name__]
        required = set(query.get("required", ()))
        for name, schema in query["properties"].items():
            param = {"name": name, "in": "query", "required": name in required, "schema": schema}
            if "description" in schema:
                param["description"] = schema["description"]
            parameters.append(param)
    if parameters:
        op["parameters"] = parameters
    if route.request is not None and _is_struct(route.request):
        content = {"application/json": {"schema": by_type[route.request]}}
        op["requestBody"] = {"required": True, "content": content}
    if route.status == 204:
        response: dict[str, Any] = {"description": "No content"}
    else:
        schema = by_type.get(route.reply, {}) if route.reply is not None else {}
        response = {"description": "OK", "content": {route.media_type: {"schema": schema}}}
    op["responses"] = {str(route.status): response}
    return _merged(op, route.docs)


def _merged(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _is_struct(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, msgspec.Struct)


# ---------------------------------------------------------------------------- the pages


def docs_routes(title: str, access: Access, document_of: Any) -> tuple[Route, ...]:
    """``/openapi.json`` (``document_of(context)``), ``/docs`` (Swagger UI),
    ``/docs/oauth2-redirect`` and ``/redoc``, readable under ``access``; undocumented."""

    async def openapi_json(context: Any, call: Call[None, None]) -> Reply:
        return Reply(msgspec.json.encode(document_of(context)))

    async def swagger(context: Any, call: Call[None, None]) -> Reply:
        from fastapi.openapi.docs import get_swagger_ui_html  # the pages only: not at start-up

        root = call.scope.get("root_path", "")
        page = get_swagger_ui_html(
            openapi_url=root + "/openapi.json",
            title=f"{title} - Swagger UI",
            oauth2_redirect_url=root + "/docs/oauth2-redirect",
        )
        return Reply(bytes(page.body), media_type=_HTML)

    async def oauth2_redirect(context: Any, call: Call[None, None]) -> Reply:
        from fastapi.openapi.docs import get_swagger_ui_oauth2_redirect_html

        return Reply(bytes(get_swagger_ui_oauth2_redirect_html().body), media_type=_HTML)

    async def redoc(context: Any, call: Call[None, None]) -> Reply:
        from fastapi.openapi.docs import get_redoc_html

        root = call.scope.get("root_path", "")
        page = get_redoc_html(openapi_url=root + "/openapi.json", title=f"{title} - ReDoc")
        return Reply(bytes(page.body), media_type=_HTML)

    return tuple(
        Route("GET", path, access, handler, hidden=True)
        for path, handler in (
            ("/openapi.json", openapi_json),
            ("/docs", swagger),
            ("/docs/oauth2-redirect", oauth2_redirect),
            ("/redoc", redoc),
        )
    )
