"""The operator's view without a browser (docs/operator.md): value reports and the regret
ratio, the status page's auth and escaping, node metrics, and the dashboard and alert rules
naming only metrics that a running coordinator or node exports."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.asgi_thread import free_port
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.node_reports import NodeReport, NodeReports, ValueCounters
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.errors import Unprocessable
from kvatlas.node import EmbeddedFleet, NodeConfig, NodeEngineClient
from kvatlas.node.embedded import InProcessPeer
from kvatlas.node.peer import PeerReply
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, RedisServer, wait_for
from tests.helpers import write_tokens

ROOT = Path(__file__).resolve().parent.parent
C = 16
MODEL = ["--model-name", "toy", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
         "--chunk-size", str(C), "--dtype", "float32", "--l2", "none"]  # fmt: skip
LAYOUT = NodeConfig(
    model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32"
).layout
ADMIN = "admin-" + "a" * 32
NODE = "node-a-" + "n" * 32
TENANT_LOOKUP = "tenant-lookup-" + "l" * 32
ENGINE = "engine-" + "e" * 32


def private(path: Path, doc: str) -> Path:
    path.write_text(doc)
    path.chmod(0o600)
    return path


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def report(boot: str = "b1", **counts: int) -> NodeReport:
    return NodeReport.from_wire({"boot": boot, **counts})


# ---------------------------------------------------------------------------- value reports


def test_reports_are_cumulative_so_repeats_and_losses_change_nothing() -> None:
    reports = NodeReports()
    reports.accept("a", report(query_tokens=100, prefix_hit_tokens=40, regret_tokens=6))
    reports.accept("a", report(query_tokens=100, prefix_hit_tokens=40, regret_tokens=6))
    # the report at 150 was lost: the next one carries it
    reports.accept("a", report(query_tokens=200, prefix_hit_tokens=90, regret_tokens=12))
    reports.accept("b", report(query_tokens=50))
    assert reports.totals() == ValueCounters(250, 90, 0, 12)
    assert reports.totals().recomputed_tokens == 160
    # a restarted node (new boot) counts from zero again
    reports.accept("a", report("b2", query_tokens=10))
    assert reports.totals().query_tokens == 260


def fleet_query_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvatlas_fleet_query_tokens_total ")
    )


def test_a_node_running_through_a_coordinator_restart_is_counted_once(tmp_path: Path) -> None:
    """The totals are the fleet's since this coordinator started: the first report of a node
    that kept running through the restart (restored from the snapshot, same boot) is its
    baseline, not 1,000 tokens again (Prometheus counts the growth on each side of the
    counter's reset: 2,010 for 1,010 served)."""
    settings = {"chunk_size": C, "snapshot_path": tmp_path / "c.snap",
                "snapshot_interval": 3600.0, "instance_timeout": 600.0}  # fmt: skip
    with BackgroundServer(CoordinatorConfig(port=free_port(), **settings)) as server:
        url = server.url
        assert httpx.post(f"{url}/instances", json={"instance_id": "n1"}).status_code == 200
        assert httpx.put(f"{url}/instances/n1/report", json={"boot": "b1", "query_tokens": 1000})
        assert fleet_query_tokens(url) == 1000
    with BackgroundServer(CoordinatorConfig(port=free_port(), **settings)) as server:
        url = server.url
        restarted = fleet_query_tokens(url)
        for served in (1010, 1030):  # the same node, same boot: 10 then 20 more tokens
            put = httpx.put(
                f"{url}/instances/n1/report", json={"boot": "b1", "query_tokens": served}
            )
            assert put.status_code == 200, put.text
        assert fleet_query_tokens(url) - restarted == 20
        # a node that restarts (a new boot, registered again) counts from zero
        assert httpx.post(f"{url}/instances", json={"instance_id": "n1"}).status_code == 200
        assert httpx.put(f"{url}/instances/n1/report", json={"boot": "b2", "query_tokens": 5})
        # a node new to this coordinator counts whole: it served them since it started
        assert httpx.post(f"{url}/instances", json={"instance_id": "n2"}).status_code == 200
        assert httpx.put(f"{url}/instances/n2/report", json={"boot": "b1", "query_tokens": 7})
        assert fleet_query_tokens(url) - restarted == 20 + 5 + 7


def test_a_node_fenced_and_registered_again_is_not_counted_twice() -> None:
    """A node whose heartbeats stopped long enough to be forgotten registers again with the
    same boot: its next report counts its growth, not its whole counters again."""
    reports = NodeReports()
    reports.accept("a", report(query_tokens=100))
    reports.retain(set())  # fenced: its tiers leave the status page
    assert reports.tiers() == {}
    reports.accept("a", report(query_tokens=120))
    assert reports.totals().query_tokens == 120


@pytest.mark.parametrize(
    "body",
    [
        {"query_tokens": 1},  # no boot
        {"boot": "b", "query_tokens": -1},
        {"boot": "b", "query_tokens": 1.5},
        {"boot": "b", "query_tokens": True},
        {"boot": "b", "recomputed_tokens": 5},  # derived, never reported
        {"boot": "x" * 65},
        [],
    ],
)
def test_a_bad_report_is_refused(body: object) -> None:
    with pytest.raises(Unprocessable):
        NodeReport.from_wire(body)


def test_regret_counts_what_another_instance_held_but_was_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node-0's chunks sit in its private L2 (listed), but its peer API is down: node-1
    recomputes the same prompt, and every token of it is regret."""
    flags = dict(model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C,
                 dtype="float32", l2="fs", l2_write="evict")  # fmt: skip
    chunk_bytes = NodeConfig(**flags).layout.chunk_bytes  # type: ignore[arg-type]
    configs = [NodeConfig(**flags, l1_bytes=chunk_bytes) for _ in range(2)]  # type: ignore[arg-type]
    tokens = np.arange(3 * C, dtype=np.uint32)
    with EmbeddedFleet(configs, l2_root=tmp_path) as fleet:
        first, second = fleet.nodes.values()
        kv = [np.ones(LAYOUT.shape, np.float32)] * 3
        assert first.store(first.tracker(token_ids=tokens), kv) == 3
        fleet.settle()
        down = PeerReply(failure="unreachable")
        monkeypatch.setattr(InProcessPeer, "fetch", lambda *_a, **_k: down)
        got = second.retrieve(second.tracker(token_ids=tokens))
        assert got.hit_tokens == 0
        assert second.counters["regret_tokens"] == 3 * C
        assert second.counters["query_tokens"] == 3 * C
        fresh = np.arange(10_000, 10_000 + 2 * C, dtype=np.uint32)
        second.retrieve(second.tracker(token_ids=fresh))  # held by nobody: no regret
        assert second.counters["regret_tokens"] == 3 * C
        got = first.retrieve(first.tracker(token_ids=tokens))  # its own L2: a hit
        assert got.hit_tokens == 3 * C and first.counters.get("regret_tokens", 0) == 0
        text = "\n".join(
            f"{s.name} {s.value}"
            for fam in text_string_to_metric_families(_scrape(second))
            for s in fam.samples
        )
        assert f"kvatlas_node_regret_tokens_total {3 * C}.0" in text
        assert f"kvatlas_node_query_tokens_total {5 * C}.0" in text


def _scrape(node: object) -> str:
    from prometheus_client import generate_latest

    return generate_latest(node.timings.registry).decode()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- auth, escaping


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[str]:
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": ADMIN, "roles": ["admin"]},
        {"token": NODE, "roles": ["emit", "lookup"], "instance_ids": ["node-a"],
         "cache_salts": ["t1"]},
        {"token": TENANT_LOOKUP, "roles": ["lookup"], "cache_salts": ["t1"]},
    )  # fmt: skip
    config = CoordinatorConfig(port=free_port(), auth_token_file=tokens, log_level="warning")
    with BackgroundServer(config) as server:
        yield server.url


def test_with_auth_the_page_is_a_shell_and_the_data_needs_an_unbound_token(secured: str) -> None:
    url = secured
    reg = httpx.post(f"{url}/instances", json={"instance_id": "node-a"}, headers=bearer(NODE))
    assert reg.status_code == 200, reg.text
    for path in ("/", "/status"):
        page = httpx.get(url + path)
        assert page.status_code == 200
        assert "Token needed" in page.text and "node-a" not in page.text
        assert "script-src 'nonce-" in page.headers["content-security-policy"]
    for path in ("/status/fragment", "/status.json"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers=bearer(TENANT_LOOKUP)).status_code == 403
        assert httpx.get(url + path, headers=bearer(NODE)).status_code == 403
        allowed = httpx.get(url + path, headers=bearer(ADMIN))
        assert allowed.status_code == 200 and "node-a" in allowed.text
    fragment = httpx.get(url + "/status/fragment", headers=bearer(ADMIN))  # opened on its own:
    assert "default-src 'none'" in fragment.headers["content-security-policy"]  # nothing runs


def test_a_node_reports_only_for_itself_and_only_registered(secured: str) -> None:
    url = secured
    body = {"boot": "b1", "query_tokens": 64, "prefix_hit_tokens": 16, "regret_tokens": 32}
    put = f"{url}/instances/node-a/report"
    assert httpx.put(put, json=body).status_code == 401
    assert httpx.put(put, json=body, headers=bearer(NODE)).status_code == 404  # not registered
    httpx.post(f"{url}/instances", json={"instance_id": "node-a"}, headers=bearer(NODE))
    other = httpx.put(f"{url}/instances/node-b/report", json=body, headers=bearer(NODE))
    assert other.status_code == 403
    bad = httpx.put(put, json={**body, "extra": 1}, headers=bearer(NODE))
    assert bad.status_code == 422 and "extra" in bad.json()["detail"]
    assert httpx.put(put, json=body, headers=bearer(NODE)).status_code == 200
    value = httpx.get(f"{url}/status.json", headers=bearer(ADMIN)).json()["value"]
    assert value["query_tokens"] == 64 and value["recomputed_tokens"] == 48
    metrics = httpx.get(f"{url}/metrics", headers=bearer(ADMIN)).text
    assert "kvatlas_fleet_regret_tokens_total 32.0" in metrics


def test_every_string_on_the_page_is_escaped() -> None:
    evil = "<img src=x onerror=alert(1)>"
    backend = '"><script>alert(1)</script>'
    with BackgroundServer(CoordinatorConfig(port=free_port(), log_level="warning")) as server:
        reply = httpx.post(
            f"{server.url}/instances", json={"instance_id": evil, "metadata": {"backend": backend}}
        )
        assert reply.status_code == 200
        page = httpx.get(f"{server.url}/status").text
    assert evil not in page and backend not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 1  # the page's own


# ---------------------------------------------------------------------------- real processes


class Fleet:
    def __init__(self, coordinator: str, node_peer: str, node_engine: str) -> None:
        self.coordinator, self.node_peer, self.node_engine = coordinator, node_peer, node_engine


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A coordinator and a node, both with auth, as processes; the node served traffic."""
    tmp = tmp_path_factory.mktemp("operator")
    coord_tokens = write_tokens(
        tmp / "coord.json",
        {"token": ADMIN, "roles": ["admin"]},
        {"token": NODE, "roles": ["emit", "lookup"], "instance_ids": ["node-a"],
         "cache_salts": ["t1"]},
    )  # fmt: skip
    node_tokens = write_tokens(
        tmp / "node.json",
        {"token": ADMIN, "roles": ["admin"]},
        {"token": ENGINE, "roles": ["engine"], "cache_salts": ["t1"]},
    )  # fmt: skip
    node_token = private(tmp / "node-token", NODE)
    cport, pport, eport = free_port(), free_port(), free_port()
    coordinator = f"http://127.0.0.1:{cport}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(cport), "--chunk-size", str(C),
             "--enable-blend-lookup", "--auth-token-file", str(coord_tokens),
             "--snapshot-path", str(tmp / "snapshot"), "--snapshot-interval", "1",
             "--log-level", "warning"], coordinator))  # fmt: skip
        procs.append(spawn_service(
            ["-m", "kvatlas.cli", "node", *MODEL, "--port", str(pport), "--engine-port",
             str(eport), "--instance-id", "node-a", "--coordinator-url", coordinator,
             "--coordinator-event-reporting", "--coordinator-token-file", str(node_token),
             "--auth-token-file", str(node_tokens), "--log-level", "warning"],
            f"http://127.0.0.1:{pport}"))  # fmt: skip
        engine = f"http://127.0.0.1:{eport}"
        with NodeEngineClient(engine, LAYOUT, token=ENGINE) as client:
            tokens = np.arange(4 * C, dtype=np.uint32)
            kv = [np.ones(LAYOUT.shape, np.float32)] * 4
            client.store(tokens, kv, cache_salt="t1", request_id="r1")
            client.retrieve(tokens, cache_salt="t1", request_id="r2")
            client.retrieve(tokens + 1000, cache_salt="t1", request_id="r3")
        yield Fleet(coordinator, f"http://127.0.0.1:{pport}", engine)
    finally:
        stop(procs)


def test_node_metrics_need_an_admin_token_with_auth_on(fleet: Fleet) -> None:
    url = f"{fleet.node_peer}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=bearer(ENGINE)).status_code == 403
    text = httpx.get(url, headers=bearer(ADMIN)).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("kvatlas_node_chunks_stored_total", ())] == 4
    assert samples[("kvatlas_node_query_tokens_total", ())] == 8 * C
    assert samples[("kvatlas_node_hit_tokens_total", (("kind", "prefix"),))] == 4 * C
    assert samples[("kvatlas_node_l1_capacity_bytes", ())] > 0
    assert samples[("kvatlas_node_fetch_seconds_count", (("source", "local_l1"),))] >= 2


def test_the_node_reports_its_value_to_the_coordinator(fleet: Fleet) -> None:
    def value() -> dict[str, int]:
        status = HTTP.get(f"{fleet.coordinator}/status.json", headers=bearer(ADMIN)).json()
        v: dict[str, int] = status["value"]
        return v

    assert wait_for(lambda: value()["query_tokens"] == 8 * C, 30, interval=0.5)  # heartbeat: 5 s
    assert value()["prefix_hit_tokens"] == 4 * C and value()["recomputed_tokens"] == 4 * C


def _referenced() -> set[str]:
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    exprs = [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    dashboard = json.loads((ROOT / "deploy/grafana/kvatlas.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\bkvatlas_[a-z0-9_]+", expr)}


def _exported(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type in ("counter",):
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
    return names


def test_dashboard_and_alerts_name_only_exported_metrics(fleet: Fleet) -> None:
    referenced = _referenced()
    assert len(referenced) > 30

    def coordinator() -> str:
        return HTTP.get(f"{fleet.coordinator}/metrics", headers=bearer(ADMIN)).text

    assert wait_for(lambda: "kvatlas_snapshot_age_seconds " in coordinator(), 30, interval=0.5)
    exported = _exported(coordinator())
    exported |= _exported(httpx.get(f"{fleet.node_peer}/metrics", headers=bearer(ADMIN)).text)
    assert sorted(referenced - exported) == []


def test_the_coordinator_exports_the_event_streams_length(redis_server: RedisServer) -> None:
    stream = f"kvatlas:test-length-{free_port()}"
    client = redis.Redis.from_url(redis_server.url)
    for i in range(3):  # not batches: refused by the consumer, but they are in the stream
        client.xadd(stream, {"junk": str(i)})
    config = CoordinatorConfig(
        port=free_port(), event_transport="redis", redis_url=redis_server.url,
        event_stream=stream, log_level="warning",
    )  # fmt: skip
    with BackgroundServer(config) as server:
        metrics = httpx.get(f"{server.url}/metrics").text
        page = httpx.get(f"{server.url}/status").text
    client.delete(stream)
    client.close()
    assert "kvatlas_event_stream_length 3.0" in metrics
    assert "<dt>stream length</dt><dd>3</dd>" in page
