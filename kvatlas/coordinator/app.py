"""The coordinator's HTTP API as an ASGI app: wiring only (routes live in ``routes/``, request
validation in ``query.py``, replies in ``wire.py``). See docs/coordinator.md ("API").

Every error is a 4xx with a JSON ``detail`` that says what was wrong (rendered by
:mod:`kvatlas.web` from :mod:`kvatlas.errors`); a 5xx is a bug. Work that scales with the
request (decoding, applying, hashing, matching) runs in worker threads, never on the event
loop, so one large request cannot stall the others; with auth on, no body is read before
the caller's token and roles were checked (``asgi.Authenticate``, docs/security.md).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI

from kvatlas import __version__
from kvatlas.coordinator.asgi import Authenticate, BlendFastPath, install_validation_handler
from kvatlas.coordinator.blend_lookup import BlendLookup
from kvatlas.coordinator.events_fast_path import EventsFastPath, EventsIngest
from kvatlas.coordinator.route_score import RouteScoring
from kvatlas.coordinator.routes import ROUTERS
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.web import BodyLimit, install_error_handler


def create_app(service: CoordinatorService) -> FastAPI:
    app = FastAPI(
        title="kvatlas coordinator",
        version=__version__,
        description="Where every cached KV chunk of the fleet lives: prefix and blend lookup.",
    )
    # Matching runs off the event loop on as many threads as there are cores: more threads
    # would only contend for the GIL between the compiled (nogil) scans and add latency.
    match_pool = ThreadPoolExecutor(
        max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="kvatlas-match"
    )
    blend = BlendLookup(service, match_pool)
    app.state.service = service  # what routes/deps.py hands to the routes
    app.state.blend_lookup = blend
    app.state.route_scoring = RouteScoring(service, match_pool)
    # Applying is serialised by the directory lock; a second thread lets one body decode (the
    # JSON token parser releases the GIL) while another applies.
    events = EventsIngest(service, ThreadPoolExecutor(2, thread_name_prefix="kvatlas-ingest"))
    app.state.events_ingest = events
    install_error_handler(app)
    install_validation_handler(app)
    for router in ROUTERS:
        app.include_router(router)
    config = service.config
    app.add_middleware(BlendFastPath, lookup=blend, auth=service.auth)
    app.add_middleware(EventsFastPath, ingest=events, auth=service.auth)
    app.add_middleware(BodyLimit, max_bytes=config.body_limit)
    app.add_middleware(  # outermost: no body byte is read before the token was checked
        Authenticate,
        auth=service.auth,
        public_metrics=config.metrics_public,
        public_docs=config.docs_public,
    )
    return app
