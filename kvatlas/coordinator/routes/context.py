"""What every route's handler works on: the service, the handlers the hot routes share their
pools through (blend lookup, route scoring, events ingest) and the prefix lookups' pool.
``app.py`` makes one per app.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

from kvatlas.coordinator.blend_lookup import BlendLookup
from kvatlas.coordinator.events_ingest import EventsIngest
from kvatlas.coordinator.route_score import RouteScoring
from kvatlas.coordinator.service import CoordinatorService


@dataclass(frozen=True, slots=True)
class Context:
    service: CoordinatorService
    blend: BlendLookup
    scoring: RouteScoring
    events: EventsIngest
    lookup_pool: Executor
    """The threads prefix lookups run on, as many as there are cores (``app.new_query_pool``)."""
