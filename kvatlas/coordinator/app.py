"""The coordinator's HTTP API as an ASGI app: wiring only (routes live in ``routes/``, request
validation in ``query.py``, replies in ``wire.py``). See docs/coordinator.md ("API").

Every error is a 4xx with a JSON ``detail`` that says what was wrong (rendered by
:mod:`kvatlas.web` from :mod:`kvatlas.errors`); a 5xx is a bug. Work that scales with the
request (decoding, applying, hashing, matching) runs in worker threads, not on the event loop,
so one large request cannot stall the others (a blend lookup of bounded size excepted:
``blend_lookup.INLINE_BODY_BYTES``); with auth on, no body is read before the caller's token
and roles were checked (``asgi.Gate``, docs/security.md).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from kvatlas import __version__
from kvatlas.coordinator.asgi import (
    Authenticate,
    FastPaths,
    FastRoute,
    Gate,
    install_validation_handler,
)
from kvatlas.coordinator.blend_lookup import BLEND_LOOKUP_PATH, BlendLookup
from kvatlas.coordinator.events_ingest import EVENTS_PATH, EventsIngest
from kvatlas.coordinator.route_score import ROUTE_SCORE_PATH, RouteScoring
from kvatlas.coordinator.routes import ROUTERS
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.http_guard import OnRefused
from kvatlas.web import install_error_handler


class CoordinatorApp(FastAPI):
    """The coordinator's FastAPI app behind :class:`~kvatlas.coordinator.asgi.FastPaths`:
    requests to :attr:`fast_routes` are answered before FastAPI sees them (its telemetry
    check, its middleware stack, routing); each fast route is one entry (``create_app``)."""

    def __init__(self, gate: Gate, on_refused: OnRefused, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes: dict[tuple[str, str], FastRoute] = {}
        self.front = FastPaths(self.framework, self.fast_routes, gate, on_refused)

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI itself: everything the fast paths do not answer."""
        await super().__call__(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)


def create_app(service: CoordinatorService) -> CoordinatorApp:
    config = service.config
    gate = Gate(service.auth, config.metrics_public, config.docs_public, config.route_bodies)
    refused = service.metrics.http_refused.count
    app = CoordinatorApp(
        gate,
        refused,
        title="kvatlas coordinator",
        version=__version__,
        description="Where every cached KV chunk of the fleet lives: prefix and blend lookup.",
    )
    # Long queries are matched off the event loop on as many threads as there are cores: more
    # threads would only contend for the GIL between the compiled (nogil) scans.
    match_pool = ThreadPoolExecutor(
        max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="kvatlas-match"
    )
    blend = BlendLookup(service, match_pool)
    app.state.service = service  # what routes/deps.py hands to the routes
    app.state.blend_lookup = blend
    scoring = app.state.route_scoring = RouteScoring(service, match_pool)
    # Applying is serialised by the directory lock; a second thread lets one body decode (the
    # JSON token parser releases the GIL on a large body) while another applies.
    events = EventsIngest(service, ThreadPoolExecutor(2, thread_name_prefix="kvatlas-ingest"))
    app.state.events_ingest = events
    install_error_handler(app, refused)
    install_validation_handler(app)
    for router in ROUTERS:
        app.include_router(router)
    app.fast_routes[("POST", BLEND_LOOKUP_PATH)] = blend.fast_route
    app.fast_routes[("POST", EVENTS_PATH)] = events.fast_route
    app.fast_routes[("POST", ROUTE_SCORE_PATH)] = scoring.fast_route
    # outermost in the framework: no body byte is read before the token was checked, and
    # then at most the route's own limit (asgi.ROUTES)
    app.add_middleware(Authenticate, gate=gate)
    return app
