"""``kvatlas_instance_event_age_seconds{instance_id}`` and the status page's "last event" say
how long ago an instance's last batch came (docs/operator.md): an instance this coordinator
has received no batch from has none, as ``GET /instances`` says (``seconds_since_last_event``
``null``), never the age of a retention timer (the old code reported, for an instance that
registered and left without emitting, the time since it left, and after a restart from a
snapshot, for every restored emitter, the time since the restart)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.coordinator.helpers import Emitter, post_batches, running


def event_ages(client: httpx.Client) -> dict[str, float]:
    ages = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "kvatlas_instance_event_age_seconds":
            for sample in family.samples:
                ages[sample.labels["instance_id"]] = sample.value
    return ages


def page_ages(client: httpx.Client) -> dict[str, float | None]:
    return {
        row["instance_id"]: row["event_age_s"] for row in client.get("/status.json").json()["fleet"]
    }


def since_last_event(client: httpx.Client) -> dict[str, float | None]:
    rows = client.get("/instances").json()["instances"]
    return {row["instance_id"]: row["seconds_since_last_event"] for row in rows}


def test_an_instance_that_never_emitted_has_no_event_age() -> None:
    now = [1000.0]
    with running(clock=lambda: now[0], instance_timeout=600.0) as (server, client):
        loud = Emitter("loud")
        for instance_id in ("loud", "quiet"):
            assert client.post("/instances", json={"instance_id": instance_id}).status_code == 200
        assert post_batches(client, loud.store_chunks(list(range(8)))).status_code == 200
        now[0] += 30.0
        assert client.delete("/instances/quiet").status_code == 204
        server.service.forget_departed()
        assert event_ages(client) == {"loud": 30.0}
        assert page_ages(client) == {"loud": 30.0}


def test_after_a_restart_an_emitter_has_no_event_age_until_it_sends_again(
    tmp_path: Path,
) -> None:
    settings = {"snapshot_path": tmp_path / "c.snap", "instance_timeout": 600.0}
    now = [1000.0]
    loud = Emitter("loud")
    with running(clock=lambda: now[0], **settings) as (_server, client):
        assert client.post("/instances", json={"instance_id": "loud"}).status_code == 200
        assert post_batches(client, loud.store_chunks(list(range(8)))).status_code == 200
    now[0] = 5000.0
    with running(clock=lambda: now[0], **settings) as (server, client):
        server.service.forget_departed()  # what the sweeper does within a second
        now[0] += 20.0
        assert since_last_event(client) == {"loud": None}
        assert event_ages(client) == {}
        assert page_ages(client) == {"loud": None}
        assert post_batches(client, loud.store_chunks(list(range(8, 16)))).status_code == 200
        now[0] += 5.0
        assert event_ages(client) == {"loud": 5.0}
        assert page_ages(client) == {"loud": 5.0}
