"""The coordinator's HTTP API as an ASGI app: its route table (``routes.ROUTES`` and the
documentation's routes) served by one :class:`~kvatlas.dispatch.Dispatcher`. See
docs/coordinator.md ("API").

Every error is a 4xx with a JSON ``detail`` that says what was wrong (rendered by
:mod:`kvatlas.web` from :mod:`kvatlas.errors`); a 5xx is a bug. Work that scales with the
request (decoding, applying, hashing, matching) runs in worker threads, not on the event loop,
so one large request cannot stall the others (a blend lookup of bounded size excepted:
``blend_lookup.INLINE_BODY_BYTES``); with auth on, no body is read before the caller's token
and roles were checked (:mod:`kvatlas.dispatch`, docs/security.md).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from kvatlas import __version__, openapi
from kvatlas.coordinator.blend_lookup import BlendLookup
from kvatlas.coordinator.body_limits import RouteBodies
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.events_ingest import EventsIngest
from kvatlas.coordinator.route_score import RouteScoring
from kvatlas.coordinator.routes import DOCS, ROUTES, Context
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.dispatch import Dispatcher
from kvatlas.routing import Route, RouteTable

TITLE = "kvatlas coordinator"
DESCRIPTION = "Where every cached KV chunk of the fleet lives: prefix and blend lookup."


@cache
def api_document() -> dict[str, Any]:
    """``/openapi.json``: the table, documented (the same for every app)."""
    return openapi.document(TITLE, __version__, DESCRIPTION, ROUTES)


TABLE = RouteTable((*ROUTES, *openapi.docs_routes(TITLE, DOCS, lambda _ctx: api_document())))
"""Every route the coordinator serves."""


def body_limit(route: Route, bodies: RouteBodies) -> int:
    """The body limit of ``route``: its own largest legitimate body, else a small one."""
    return bodies.small if route.body is None else int(route.body(bodies))


def route_body_limit(method: str, path: str, config: CoordinatorConfig) -> int:
    """The body limit of the request ``method path`` under ``config``."""
    found = TABLE.match(method, path)
    bodies = config.route_bodies
    return bodies.small if found is None else body_limit(found[0], bodies)


class CoordinatorApp(Dispatcher):
    """The coordinator's app: :data:`TABLE` served over ``context``."""

    title = TITLE
    version = __version__

    def openapi(self) -> dict[str, Any]:
        return api_document()


def new_query_pool(name: str = "kvatlas-match") -> ThreadPoolExecutor:
    """Threads for long queries, off the event loop: as many as there are cores (more would
    only contend for the GIL and the directory lock)."""
    return ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix=name)


def create_app(service: CoordinatorService, table: RouteTable = TABLE) -> CoordinatorApp:
    """The app serving ``table`` (the coordinator's, or one with more routes) for ``service``."""
    config = service.config
    match_pool = new_query_pool()
    # Applying is serialised by the directory lock; a second thread lets one body decode (the
    # JSON token parser releases the GIL on a large body) while another applies.
    events = EventsIngest(service, ThreadPoolExecutor(2, thread_name_prefix="kvatlas-ingest"))
    context = Context(
        service,
        BlendLookup(service, match_pool),
        RouteScoring(service, match_pool),
        events,
        # prefix lookups on a pool of their own: one of tens of MB never holds up the
        # matches and scores of the pool above
        new_query_pool("kvatlas-lookup"),
    )
    public = {"metrics"} if config.metrics_public else set()
    if config.docs_public:
        public.add("docs")
    bodies = config.route_bodies
    return CoordinatorApp(
        context,
        table,
        service.auth,
        frozenset(public),
        lambda route: body_limit(route, bodies),
        bodies.small,
        service.metrics.http_refused.count,
    )
