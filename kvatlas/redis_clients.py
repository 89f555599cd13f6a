"""The Redis clients of the event stream's roles (coordinator, emitter): they send exactly the
commands the ACL users of ``deploy/redis/users.acl`` are granted (docs/security.md).

redis-py (5.0 and later) announces itself on every new connection with ``CLIENT SETINFO``,
ignoring a refusal. Under a least-privilege ACL user that refusal is a ``NOPERM`` on Redis 7.2
and later, logged in ``ACL LOG`` for every connection; granting ``client|setinfo`` instead is
impossible on Redis 7.0 (an ACL file naming it does not load). So kvatlas's clients do not
announce themselves.
"""

from __future__ import annotations

import inspect
from typing import Any


def redis_client(url: str, *, socket_timeout: float, socket_connect_timeout: float = 5.0) -> Any:
    """A ``redis.Redis`` of ``url`` (connects lazily) that sends no ``CLIENT SETINFO``."""
    import redis

    params = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    if "driver_info" in params:  # redis-py >= 8.1: lib_name / lib_version are deprecated
        silent: dict[str, Any] = {"driver_info": None}
    else:
        silent = {"lib_name": None, "lib_version": None}
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        **silent,
    )
