"""What a client may hold of a service's HTTP server, as settings: the limits the HTTP guard
(:mod:`kvatlas.http_guard`) applies (:class:`HttpLimits`, the ``--http-*`` flags and their
help), and the counter of what it refused (:class:`HttpRefusals`, the label values
:data:`REFUSALS`). See docs/security.md.
"""

from __future__ import annotations

import math
import resource
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

RESERVED_FDS = 64
"""File descriptors kept out of the connection cap at least (an eighth of the limit when
that is more): the listeners, the snapshot, Redis and peer connections, L2 files, logs."""
NESTED_TOO_DEEP = "nested_too_deep"
"""The reason of a body nested deeper than a decoder follows (:func:`kvatlas.web.nested_too_deep`)."""
REFUSALS = ("over_cap", "header_timeout", "body_timeout", NESTED_TOO_DEEP)
"""Why the HTTP layer refused a connection or a request (the label of
``kvatlas_http_refused_total``): the guard's three, and a body nested deeper than the
decoders follow (:mod:`kvatlas.web`)."""


def default_max_connections(file_limit: int | None = None) -> int:
    """The connection cap below the process's file limit (soft ``RLIMIT_NOFILE``, or
    ``file_limit``): the limit less :data:`RESERVED_FDS` or an eighth of it."""
    if file_limit is None:
        file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if file_limit == resource.RLIM_INFINITY:
            file_limit = 1 << 20
    return max(1, file_limit - max(RESERVED_FDS, file_limit // 8))


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """``--http-header-timeout-s``, ``--http-body-timeout-s``, ``--http-max-connections``
    (``None``: :func:`default_max_connections`)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--http-{name.replace('_', '-')} must be a finite number > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("--http-max-connections must be >= 1")

    @property
    def connection_cap(self) -> int:
        if self.max_connections is None:
            return default_max_connections()
        return self.max_connections


HEADER_TIMEOUT_HELP = (
    "seconds a client has to send a request's headers, from connecting or from the previous "
    "reply; then the connection is closed"
)
BODY_TIMEOUT_HELP = (
    "longest wait, in seconds, for the next piece of a request body; then 408 and the "
    "connection is closed"
)
MAX_CONNECTIONS_HELP = (
    "most open HTTP connections; one more is closed when accepted (default: the file limit, "
    "RLIMIT_NOFILE, less an eighth and at least 64)"
)

OnRefused = Callable[[str], object]
"""Called with the reason (one of :data:`REFUSALS`) of each connection the guard closes."""


class HttpRefusals(Collector):
    """``kvatlas_http_refused_total{reason}`` on a service's registry: :meth:`count` is the
    guard's (and the nesting check's) :data:`OnRefused`. Every reason is exported from the
    start (0), so a series never appears out of nowhere."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def count(self, reason: str) -> None:
        self.counts[reason] += 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvatlas_http_refused",
            "connections and requests the HTTP layer refused, by reason",
            labels=["reason"],
        )
        for reason in REFUSALS:
            family.add_metric([reason], self.counts[reason])
        yield family
