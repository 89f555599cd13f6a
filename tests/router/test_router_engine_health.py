"""``kvatlas router`` (a real process, its log read from its output) in front of an engine
that is fine, one whose URL is not an engine (a web server answering 404 to everything) and one
whose URL nobody listens on: every health check's failure is said once, when the engine goes
out (a WARNING naming it and why), and its return once (an INFO), never once per probe."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for

PROBES = 5
"""Health checks each engine must have had before the log is read (each could have logged)."""


class Probed:
    """A loopback HTTP server counting the requests it had; as an engine (``engine=True``)
    ``/health`` answers :attr:`status`, ``/v1/models`` one model; otherwise every path is a
    404, as a web server that is not an engine."""

    def __init__(self, engine: bool) -> None:
        self.hits = 0
        self.status = 200
        routes = [
            Route("/health", self.health),
            Route("/v1/models", lambda _: JSONResponse({"data": [{"id": "toy"}]})),
            Route("/metrics", lambda _: PlainTextResponse("")),
        ]
        if not engine:
            routes = [Route("/{path:path}", self.not_an_engine)]
        self.server = ThreadedServer(Starlette(routes=routes), port=free_port())
        self.server.start()

    async def health(self, _: Request) -> Response:
        self.hits += 1
        return Response(status_code=self.status)

    async def not_an_engine(self, _: Request) -> Response:
        self.hits += 1
        return PlainTextResponse("Not Found", 404)


@pytest.fixture
def engines() -> Iterator[dict[str, Any]]:
    good, other = Probed(engine=True), Probed(engine=False)
    yield {"good": good, "web": other, "gone": f"http://127.0.0.1:{free_port()}"}
    good.server.stop()
    other.server.stop()


def _engine_lines(log: Path, level: str, engine_id: str) -> list[str]:
    """The router's messages at ``level`` about ``engine_id`` (its JSON log lines)."""
    found = []
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") == level and entry["msg"].startswith(f"engine {engine_id} "):
            found.append(entry["msg"])
    return found


def _probed(engine: Probed) -> bool:
    """Whether ``engine`` has had :data:`PROBES` more health checks since the last call."""
    start = engine.hits
    return wait_for(lambda: engine.hits >= start + PROBES, timeout=60)


def test_an_engine_out_of_the_set_is_said_once_with_why_and_its_return_once(
    engines: dict[str, Any], tmp_path: Path
) -> None:
    good, web, gone = engines["good"], engines["web"], engines["gone"]
    log = tmp_path / "router.log"
    port = free_port()
    listed = f"good={good.server.url},web={web.server.url},gone={gone}"
    proc = spawn_service(
        ["-m", "kvatlas.cli", "router", "--port", str(port), "--policy", "round-robin",
         "--engine", listed, "--health-interval-s", "0.05", "--log-level", "info"],
        f"http://127.0.0.1:{port}", log=log,
    )  # fmt: skip
    try:
        assert _probed(web) and _probed(good)  # and "gone" as often: probed together
        # a URL nobody listens on, and one that is no engine: each said once, with why (they
        # were logged at DEBUG only, on every probe: nothing said why they were out)
        [refused] = _engine_lines(log, "WARNING", "gone")
        assert f"({gone})" in refused and "Cannot connect" in refused, refused
        [not_engine] = _engine_lines(log, "WARNING", "web")
        assert "GET /health answered 404" in not_engine, not_engine
        assert _engine_lines(log, "INFO", "gone") == _engine_lines(log, "INFO", "web") == []
        [first] = _engine_lines(log, "INFO", "good")
        assert "is healthy" in first
        assert _engine_lines(log, "WARNING", "good") == []

        good.status = 503  # out of the set: one WARNING over many failed probes
        assert _probed(good)
        assert wait_for(lambda: HTTP.get(f"http://127.0.0.1:{port}/healthz").status_code == 503)
        [out] = _engine_lines(log, "WARNING", "good")
        assert "GET /health answered 503" in out, out

        good.status = 200  # back: one INFO
        assert wait_for(lambda: HTTP.get(f"http://127.0.0.1:{port}/healthz").status_code == 200)
        assert _probed(good)
        assert len(_engine_lines(log, "INFO", "good")) == 2
        assert len(_engine_lines(log, "WARNING", "good")) == 1
        assert len(_engine_lines(log, "WARNING", "gone")) == 1  # still: no log spam
        assert len(_engine_lines(log, "WARNING", "web")) == 1
    finally:
        stop([proc])
