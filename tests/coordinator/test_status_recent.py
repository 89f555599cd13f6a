"""The status page shows the faults that just happened (issue 29 item 2): a recent-events
list, newest first with times, in ``/status.json`` and on the page; sparklines are left out
until some minute has data (no empty grey boxes)."""

from __future__ import annotations

import time

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import Registration
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.status import status_to_wire
from kvatlas.coordinator.status_page import render_body


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_fence_and_a_resync_appear_newest_first_with_times() -> None:
    clock = Clock()
    before = time.time()
    service = CoordinatorService(CoordinatorConfig(instance_timeout=30.0), clock)
    service.status.tick()
    assert [e.kind for e in service.status.view().recent] == ["start"]  # nothing else yet
    service.instances.register("n1", Registration())
    clock.now += 31
    assert service.instances.expire() == ["n1"]
    service.metrics.digest_exchanges.labels("differ").inc()
    service.metrics.digest_exchanges.labels("match").inc()  # not a fault
    service.status.tick()
    service.status.tick()  # nothing new: no repeated event
    view = service.status.view()
    kinds = [e.kind for e in view.recent]
    assert sorted(kinds[:2]) == ["fence", "resync"] and kinds[2:] == ["start"]
    assert all(before <= e.at <= time.time() for e in view.recent)
    assert "1 instance(s) fenced" in " ".join(e.detail for e in view.recent)
    wire = status_to_wire(view)
    assert [e["kind"] for e in wire["recent"]] == kinds
    body = render_body(view)
    assert 'id="recent"' in body and "fenced: heartbeats missed" in body


def test_sparklines_are_left_out_until_a_minute_has_data() -> None:
    service = CoordinatorService(CoordinatorConfig(), Clock())
    body = render_body(service.status.view())
    assert "<svg" not in body  # a fresh fleet: no empty boxes


def test_a_replica_trimmed_past_says_so() -> None:
    """A restart behind the stream's trim (``kind="trimmed"``) is a recent event of its own,
    worded for the operator (nodes talking to another replica do not repair it)."""
    service = CoordinatorService(CoordinatorConfig(), Clock())
    service.status.tick()
    service.metrics.stream_errors.labels("trimmed").inc()
    service.status.tick()
    view = service.status.view()
    assert [e.kind for e in view.recent] == ["stream", "start"]
    assert "were trimmed from the stream" in view.recent[0].detail
    assert "were trimmed from the stream" in render_body(view)
