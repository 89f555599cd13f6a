"""LMCache wire conformance (shared/spec/lmcache-conformance.md): the golden exchanges that
LMCache's own coordinator answered, replayed in order against a real ``kvatlas coordinator``
process started as they were recorded (``--chunk-size 16 --enable-blend-lookup``).

An exchange conforms when the status is the same; for a 2xx JSON answer every field LMCache
answers is present with the same JSON type (kvatlas may add fields); and the semantic fields
agree (counts, blend matches, lookup chunks and placement holders, listing totals, ``num_keys``,
``re_registered``, ``status``, usage). Ids the coordinator assigns are mapped from LMCache's to
kvatlas's before comparing; timestamps and ``/metrics`` text are not compared. LMCache's
controller endpoints (quotas, pins, prefetches, cache delete) are out of scope for now.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.processes import spawn_service, stop

DATA = Path(__file__).with_name("data")
GOLDENS = sorted(DATA.glob("lmcache-*-coordinator.json"))
OUT_OF_SCOPE = ("/quota", "/cache/pins", "/cache/prefetches", "/cache/delete")
ASSIGNED_ID = re.compile(r"^mp-[0-9a-f]{32}$")


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def out_of_scope(path: str) -> bool:
    return path.startswith(OUT_OF_SCOPE)


# --------------------------------------------------------------------------- comparison


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def shape_problems(want: Any, got: Any, where: str = "$") -> list[str]:
    """Every field of ``want`` present in ``got`` with the same JSON type; each item of a
    list has the shape of some item of kvatlas's list (counts and order: :func:`semantic`)."""
    if _json_type(want) != _json_type(got):
        return [f"{where}: LMCache {_json_type(want)} {want!r:.60}, kvatlas {got!r:.60}"]
    if isinstance(want, dict):
        out = []
        for name, value in want.items():
            if name not in got:
                out.append(f"{where}.{name}: missing (LMCache {value!r:.60})")
            else:
                out += shape_problems(value, got[name], f"{where}.{name}")
        return out
    if isinstance(want, list):  # each item has the shape of some item (order: semantic())
        out = []
        for i, item in enumerate(want):
            tries = [shape_problems(item, g, f"{where}[{i}]") for g in got]
            if not tries:
                out.append(f"{where}[{i}]: missing (kvatlas answers no items)")
            elif all(tries):
                out += min(tries, key=len)
        return out
    return []


def _holders(result: dict[str, Any]) -> list[str]:
    return sorted(p["instance_id"] for p in result["placements"])


def _modules(row: dict[str, Any]) -> list[tuple[Any, ...]]:
    return sorted(
        (
            m["tier"],
            m["backend"],
            m["shared"],
            m["used_bytes"],
            m["capacity_bytes"],
            m["usage_ratio"],
        )
        for m in row["modules"]
    )


def _usage(reply: dict[str, Any]) -> Any:
    return (reply["instance_id"], reply["registered"], reply["declared_capacity"], _modules(reply))


def semantic(method: str, path: str, reply: Any) -> Any:
    """The fields of a 2xx reply that must agree with LMCache's (by endpoint)."""
    route = path.split("?")[0]
    if route == "/events":
        return {k: reply[k] for k in ("applied", "duplicates", "stale")}
    if route == "/directory/blend-lookup":
        return [(m["chunk_hash"], m["old_st"], m["cur_st"]) for m in reply["matches"]]
    if route == "/directory/lookup":
        keys = [r["key"] for r in reply["results"]]
        return reply["chunks"], keys, [_holders(r) for r in reply["results"]]
    if route == "/directory/keys":
        return reply["total"]
    if route == "/directory/stats":
        return reply["num_keys"]
    if route == "/instances" and method == "POST":
        return reply["instance_id"], reply["re_registered"]
    if route == "/instances":
        return sorted(r["instance_id"] for r in reply["instances"])
    if route == "/instances/usage":  # by id: where an assigned (random) id sorts is not semantic
        rows = sorted(_usage(r) for r in reply["instances"])
        return rows, _modules({"modules": reply["shared_modules"]})
    if route.endswith("/usage"):
        return _usage(reply)
    if route == "/healthz":
        return reply["status"]
    return None


def _rename(value: Any, ids: dict[str, str]) -> Any:
    """LMCache's reply with the ids LMCache assigned replaced by the ones kvatlas assigned."""
    if isinstance(value, str):
        return ids.get(value, value)
    if isinstance(value, list):
        return [_rename(v, ids) for v in value]
    if isinstance(value, dict):
        return {ids.get(k, k): _rename(v, ids) for k, v in value.items()}
    return value


@dataclass
class Outcome:
    index: int
    note: str
    request: str
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    version: str
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problems]

    def summary(self) -> str:
        ok = len(self.outcomes) - len(self.failures)
        return (
            f"LMCache {self.version}: {ok} of {len(self.outcomes)} exchanges conform "
            f"({len(self.skipped)} out of scope)"
        )

    def render(self) -> str:
        lines = [self.summary()]
        for o in self.failures:
            lines.append(f"#{o.index} {o.request}  ({o.note})")
            lines += [f"    {p}" for p in o.problems]
        return "\n".join(lines)


def _send(client: httpx.Client, exchange: dict[str, Any]) -> httpx.Response:
    body = exchange["body"]
    if body is None:
        return client.request(exchange["method"], exchange["path"])
    if isinstance(body, str):  # sent as is (e.g. a body that is not JSON)
        headers = {"content-type": "application/json"}
        return client.request(exchange["method"], exchange["path"], content=body, headers=headers)
    return client.request(exchange["method"], exchange["path"], json=body)


def check(exchange: dict[str, Any], r: httpx.Response, ids: dict[str, str]) -> list[str]:
    """What does not conform in kvatlas's reply ``r`` to one golden exchange."""
    method, path, status = exchange["method"], exchange["path"], exchange["lmcache_status"]
    if r.status_code != status:
        return [f"status: LMCache {status}, kvatlas {r.status_code}: {r.text:.300}"]
    if not 200 <= status < 300 or path == "/metrics":
        return []
    want = exchange["lmcache_response"]
    if status == 204 or want == "":
        return [] if not r.content else [f"body: LMCache none, kvatlas {r.text:.100}"]
    got = r.json()
    asked = exchange["body"]
    assigns = isinstance(asked, dict) and not asked.get("instance_id")
    if path == "/instances" and method == "POST" and assigns:
        if not ASSIGNED_ID.match(str(got.get("instance_id"))):
            return [f"assigned instance_id {got.get('instance_id')!r} is not mp-<32 hex>"]
        ids[want["instance_id"]] = got["instance_id"]
    want = _rename(want, ids)
    problems = shape_problems(want, got)
    if problems:
        return problems
    expected, actual = semantic(method, path, want), semantic(method, path, got)
    if expected != actual:
        return [f"semantic: LMCache {expected!r:.500}", f"          kvatlas {actual!r:.500}"]
    return []


def replay(golden: dict[str, Any], client: httpx.Client) -> Report:
    report = Report(golden["lmcache_version"])
    ids: dict[str, str] = {}
    for i, exchange in enumerate(golden["exchanges"]):
        request = f"{exchange['method']} {exchange['path']}"
        r = _send(client, exchange)
        if out_of_scope(exchange["path"]):
            report.skipped.append(request)
            assert r.status_code < 500, (request, r.status_code, r.text)
            continue
        report.outcomes.append(Outcome(i, exchange["note"], request, check(exchange, r, ids)))
    return report


# --------------------------------------------------------------------------- the process


@pytest.fixture
def lmcache_like_coordinator() -> Iterator[httpx.Client]:
    """A real ``kvatlas coordinator`` process, flags as the goldens were recorded."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--chunk-size", "16", "--enable-blend-lookup"]
    proc: subprocess.Popen[bytes] = spawn_service(
        ["-m", "kvatlas.cli", "coordinator", *flags, "--log-level", "warning"], url
    )
    try:
        with httpx.Client(base_url=url, timeout=30.0) as client:
            yield client
    finally:
        stop([proc])


@pytest.mark.parametrize("path", GOLDENS, ids=lambda p: p.stem)
def test_every_golden_exchange_conforms(path: Path, lmcache_like_coordinator: httpx.Client) -> None:
    golden = load(path)
    assert golden["chunk_size"] == 16
    report = replay(golden, lmcache_like_coordinator)
    print(report.summary())
    assert not report.failures, report.render()
