"""The coordinator's HTTP routes, one module per resource; each route checks the caller's role,
hands the request to the layer below (``query`` to validate, the service to act, ``wire`` to
reply) and holds no logic of its own. ``app.py`` mounts them in the order of :data:`ROUTERS`,
which is the order ``/openapi.json`` lists them in. See docs/coordinator.md ("API").
"""

from kvatlas.coordinator.routes import directory, events, instances, ops, resync

ROUTERS = (events.router, directory.router, instances.router, resync.router, ops.router)

__all__ = ["ROUTERS"]
