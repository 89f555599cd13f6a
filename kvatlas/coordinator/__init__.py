"""The coordinator service: HTTP API, CLI, instances, auth, metrics, snapshots, transports.

Layers, each importing only those below it (docs/coordinator.md):

- ``server`` runs it (CLI, in-process ``BackgroundServer``); ``app`` serves the route table;
- ``routes/`` the route table (``ROUTES``) and one handler module per resource, thin:
  ``query``, service, ``wire`` (the hot routes' handlers: ``blend_lookup``, ``events_ingest``,
  ``route_score``);
- ``query`` validates requests (422 / 413); ``wire`` maps replies to their types in :mod:`kvatlas.api`;
- ``service`` (directory, instances, snapshots, background threads; independent of HTTP),
  ``stream_consumer`` (Redis Streams), ``views`` (what the service reports), ``instances``,
  ``auth``, ``metrics``, ``config``; ``runtime`` the process settings.

The exports below load on first use: ``kvatlas coordinator --help`` imports only ``config`` and
must not load the web stack or the compiled kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvatlas.lazy_exports import lazy_export

if TYPE_CHECKING:
    from kvatlas.coordinator.app import create_app
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.server import BackgroundServer
    from kvatlas.coordinator.service import CoordinatorService
    from kvatlas.coordinator.views import Readiness

_EXPORTS = {
    "BackgroundServer": "server",
    "CoordinatorConfig": "config",
    "CoordinatorService": "service",
    "Readiness": "views",
    "create_app": "app",
}
__all__ = [
    "BackgroundServer",
    "CoordinatorConfig",
    "CoordinatorService",
    "Readiness",
    "create_app",
]


def __getattr__(name: str) -> Any:
    return lazy_export(__name__, _EXPORTS, globals(), name)
