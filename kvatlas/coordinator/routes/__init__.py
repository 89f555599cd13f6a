"""The coordinator's HTTP routes, one module per resource; each route checks the caller's role,
hands the request to the layer below (``query`` to validate, the service to act, ``wire`` to
reply) and holds no logic of its own. ``app.py`` mounts them in the order of :data:`ROUTERS`,
which is the order ``/openapi.json`` lists them in. See docs/coordinator.md ("API").
"""

from kvatlas.coordinator.routes import (
    config,
    directory,
    events,
    instances,
    ops,
    resync,
    route,
    status,
    usage,
)

ROUTERS = (
    events.router,
    directory.router,
    route.router,
    usage.router,  # before instances: /instances/usage is not /instances/{instance_id}
    instances.router,
    resync.router,
    config.router,
    ops.router,
    status.router,
)

__all__ = ["ROUTERS"]
