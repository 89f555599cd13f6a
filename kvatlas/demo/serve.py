"""``kvatlas demo --serve``: after the workload, keep the fleet up and its coordinator's status
page reachable until Ctrl-C.

Embedded mode has no coordinator process, so here the embedded fleet runs around a real
coordinator service on loopback (its directory, its ingest path): the nodes are registered
with it and a pulse thread does what a node process does with every heartbeat (heartbeat and
value report). See docs/operator.md ("Demo").
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from kvatlas.asgi_thread import free_port
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import Registration
from kvatlas.coordinator.node_reports import NodeReport
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.node import EmbeddedFleet
from kvatlas.node.metrics import new_boot, value_report

PULSE_S = 2.0


@contextmanager
def coordinator(chunk_size: int) -> Iterator[BackgroundServer]:
    """A coordinator on a free loopback port with blend lookup on."""
    config = CoordinatorConfig(
        port=free_port(), chunk_size=chunk_size, enable_blend_lookup=True, log_level="warning"
    )
    with BackgroundServer(config) as server:
        yield server


@contextmanager
def registered(fleet: EmbeddedFleet, server: BackgroundServer) -> Iterator[None]:
    """Register every node of ``fleet`` with ``server``; heartbeat and report until exit."""
    service = server.service
    boot = new_boot()
    for instance_id in fleet.nodes:
        meta = {"backend": "embedded"}
        service.instances.register(instance_id, Registration(metadata=meta), None)
    stop = threading.Event()

    def pulse() -> None:
        while True:
            for instance_id, node in fleet.nodes.items():
                service.instances.heartbeat(instance_id)
                body = value_report(boot, node.counters, node.tier_gauges())
                service.status.reports.accept(instance_id, NodeReport.from_wire(body))
            if stop.wait(PULSE_S):
                return

    thread = threading.Thread(target=pulse, name="kvatlas-demo-pulse", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def hold(url: str, console: Console) -> None:
    """Print the status page URL and wait for Ctrl-C."""
    console.print(f"status page: {url}/  (the fleet stays up; Ctrl-C to stop)", soft_wrap=True)
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping")
