"""``kvatlas router`` (a real process) in front of engines that reply oddly: two raw asyncio
servers on loopback, scripted per request by a field of the body (the router passes bodies
through unchanged). What the router's engine call (``kvatlas.client.keepalive``, streamed)
must get right: Content-Length and close-delimited replies passed on, an engine dying or
stalling mid-reply giving the client an incomplete reply (an error, never a hang and never a
complete-looking reply), counted, the engine's slot freed; an engine that closes the connection
before any byte retried once on the other one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for

MODEL = "toy"
_REPLY = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                               "prompt_tokens_details": {"cached_tokens": 0}}}).encode()  # fmt: skip


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class ScriptedEngine:
    """A vLLM-shaped engine (``/health``, ``/v1/models``, ``/metrics``) whose completion replies
    follow the body's ``"script"``; with ``refuses`` it closes a ``"no-byte"`` request's
    connection without answering (the other engine answers it as usual)."""

    def __init__(self, refuses: bool) -> None:
        self.refuses = refuses
        self.stall = threading.Event()  # what a stalled reply waits for (set at close)
        self.held_closed = threading.Event()  # a held request's connection was closed
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self.ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.stall.set()
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                body = await reader.readexactly(length)
                if b'"hold"' in body:  # no reply head, as vLLM computing a non-streamed
                    # completion: wait for the router to close the connection (or time out)
                    if await reader.read(1) == b"":
                        self.held_closed.set()
                    break
                if not await self._answer(head.split(b" ")[1], body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def _answer(self, path: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write the reply; ``False`` closes the connection."""
        if path == b"/v1/models":
            data = json.dumps({"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(data), data.encode()))  # fmt: skip
            return True
        if path != b"/v1/completions":  # /health, /metrics
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return True
        script = json.loads(body).get("script")
        sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        if script == "no-byte" and self.refuses:
            return False
        if script == "sse-cut":  # one event, then the engine dies
            writer.write(sse + _chunk(b'data: {"n": 1}\n\n'))
            await writer.drain()
            return False
        if script == "length-cut":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + _REPLY[:20])
            await writer.drain()
            return False
        if script == "stall":  # one event, then nothing (the router's read timeout)
            writer.write(sse + _chunk(b'data: {"n": 1}\n\n'))
            await writer.drain()
            await asyncio.to_thread(self.stall.wait)
            return False
        if script == "close-delimited":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\n\r\n" + _REPLY[:30])  # fmt: skip
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(_REPLY[30:])
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: r-1\r\nContent-Length: %d\r\n\r\n%s" % (len(_REPLY), _REPLY))  # fmt: skip
        return True


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    engines = {"a": ScriptedEngine(refuses=True), "b": ScriptedEngine(refuses=False)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = [f for n, e in engines.items() for f in ("--engine", f"{n}={e.url}")]
    procs: list[subprocess.Popen[bytes]] = []
    log = tmp_path_factory.mktemp("router") / "router.log"
    try:
        procs.append(spawn_service(
            ["-m", "kvatlas.cli", "router", "--port", str(port), "--log-level", "error", *flags,
             "--policy", "round-robin", "--engine-timeout-s", "1", "--health-interval-s", "0.2",
             "--metrics-interval-s", "0.2"], url, log=log,
        ))  # fmt: skip
        yield {"url": url, "engines": engines, "log": log}
    finally:
        stop(procs)
        for engine in engines.values():
            engine.close()


def _metric(router: dict[str, Any], name: str) -> float:
    text = httpx.get(f"{router['url']}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))  # fmt: skip


def _idle(router: dict[str, Any]) -> bool:
    engines = HTTP.get(f"{router['url']}/healthz").json()["engines"].values()
    return all(e["in_flight"] == 0 and e["healthy"] for e in engines)


def _body(script: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [1, 2], "script": script, **extra}


def test_content_length_and_close_delimited_replies_pass_through(router: dict[str, Any]) -> None:
    for _ in range(2):  # both engines
        reply = httpx.post(f"{router['url']}/v1/completions", json=_body("plain"), timeout=30)
        assert (reply.status_code, reply.content) == (200, _REPLY)
        assert reply.headers["content-length"] == str(len(_REPLY))
        assert reply.headers["x-request-id"] == "r-1"
        # the connection the reply came on is reused: the engine's slot is free at once
        delimited = httpx.post(f"{router['url']}/v1/completions", json=_body("close-delimited"),
                               timeout=30)  # fmt: skip
        assert (delimited.status_code, delimited.content) == (200, _REPLY)
        assert delimited.headers["content-type"] == "application/json"
    assert _metric(router, "kvatlas_router_aborted_streams_total") == 0
    assert wait_for(lambda: _idle(router), timeout=10)


@pytest.mark.parametrize("script", ["sse-cut", "length-cut", "stall"])
def test_an_engine_failing_mid_reply_cuts_the_clients_reply(
    router: dict[str, Any], script: str
) -> None:
    """The engine dies (or stalls past ``--engine-timeout-s``) after the first bytes: the
    client gets those bytes and then an incomplete reply — an error from its HTTP library,
    not a hang and not a reply that looks whole; the cut is counted, the slot freed, and the
    router serves the next request."""
    before = _metric(router, "kvatlas_router_aborted_streams_total")
    got = b""
    url = f"{router['url']}/v1/completions"
    with (
        pytest.raises(httpx.RemoteProtocolError),  # the cut comes mid-read
        httpx.stream("POST", url, json=_body(script, stream=True), timeout=30) as reply,
    ):
        assert reply.status_code == 200
        for piece in reply.iter_raw():
            got += piece
    assert got in (b'data: {"n": 1}\n\n', _REPLY[:20])
    assert _metric(router, "kvatlas_router_aborted_streams_total") == before + 1
    # a cut the router made on purpose is no uvicorn ERROR ("ASGI callable returned without
    # completing response", one per cut reply: alerts on ERROR lines fired for an engine's
    # crash the router had handled); it is counted above and logged by the router (INFO)
    assert "without completing response" not in router["log"].read_text()
    assert wait_for(lambda: _idle(router), timeout=10)
    after = httpx.post(f"{router['url']}/v1/completions", json=_body("plain"), timeout=30)
    assert after.status_code == 200


def test_a_client_leaving_before_the_reply_head_stops_the_engines_request(
    router: dict[str, Any],
) -> None:
    """A non-streamed completion has no reply head until the engine is done with it: a client
    that leaves before then (its own timeout) closes the engine's connection (vLLM aborts the
    request and frees its slot), counted as a reply whose client left — not kept until the
    engine answers or ``--engine-timeout-s`` passes (then a 503 nobody reads)."""
    aborted = _metric(router, "kvatlas_router_aborted_streams_total")
    unavailable = _metric(router, 'kvatlas_router_errors_total{status="503"}')
    for engine in router["engines"].values():
        engine.held_closed.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router['url']}/v1/completions", json=_body("hold"),
                   timeout=httpx.Timeout(30, read=0.3))  # fmt: skip
    assert wait_for(lambda: any(e.held_closed.is_set() for e in router["engines"].values()),
                    timeout=10)  # fmt: skip
    assert wait_for(lambda: _idle(router), timeout=10)
    assert _metric(router, "kvatlas_router_aborted_streams_total") == aborted + 1
    assert _metric(router, 'kvatlas_router_errors_total{status="503"}') == unavailable


def test_a_connection_closed_before_any_byte_is_retried_on_the_other_engine(
    router: dict[str, Any],
) -> None:
    """Engine a accepts the request and closes without a byte: the request is answered by b
    (one retry), a leaves the set until its next health check passes."""
    before = _metric(router, "kvatlas_router_retries_total")
    for _ in range(4):  # round-robin: a is ranked first within two requests
        reply = httpx.post(f"{router['url']}/v1/completions", json=_body("no-byte"), timeout=30)
        assert (reply.status_code, reply.headers["x-kvatlas-engine"]) == (200, "b")
        if _metric(router, "kvatlas_router_retries_total") > before:
            break
    assert _metric(router, "kvatlas_router_retries_total") == before + 1
    assert wait_for(lambda: _idle(router), timeout=10)  # a is back after a health check


def test_the_filter_drops_only_a_cut_the_router_made() -> None:
    """uvicorn's line stays for a reply the router did not cut on purpose (a bug's)."""
    import contextvars
    import logging

    from kvatlas.router.replies import CutReplyFilter, mark_cut

    line = "ASGI callable returned without completing response."

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, None, None)

    def request(cut: bool, msg: str) -> bool:  # one request: its own task, its own context
        if cut:
            mark_cut()
        return CutReplyFilter().filter(record(msg))

    assert contextvars.copy_context().run(request, False, line) is True
    assert contextvars.copy_context().run(request, True, line) is False
    assert contextvars.copy_context().run(request, True, "Exception in ASGI application") is True
    assert CutReplyFilter().filter(record(line)) is True  # another request's cut: not this one
