"""Issue 25 item 9, coordinator, node and router: half-open connections are closed after the
header timeout (also when they drip header bytes), a stalled body after the body timeout (408),
a connection beyond the cap as soon as it is accepted, and with connections at the cap the
coordinator's snapshots keep being written (the cap stays below the process's file limit).
Real processes, real sockets; small counts (a cap of 50, 60 connections) prove the mechanism.
The header, body and streaming tests share one process per service with 1 s timeouts (each
counts its own refusals); the cap and snapshot tests start their own (other flags).
The router runs in front of :class:`LockstepEngine`, whose streamed pieces also show that the
guard's write coalescing (one send per loop turn) still lets each piece go as it comes.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.processes import spawn_service, stop

HANG = 30.0  # a hang detector on a loaded machine, never a latency assertion
NODE = ["--model-name", "toy", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
        "--chunk-size", "16", "--dtype", "float32", "--l2", "none"]  # fmt: skip
Spawn = tuple[Callable[..., tuple[subprocess.Popen[bytes], int]], str]


PIECES = [b'data: {"n": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]


class LockstepEngine:
    """A vLLM-shaped engine for the router (``/health``, ``/v1/models``, ``/metrics``) whose
    streamed completion sends each of :data:`PIECES` only once the test has read the one
    before (``read``, released by the test after each piece)."""

    def __init__(self) -> None:
        self.read = threading.Semaphore(0)
        app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", lambda _: Response()),
            Route("/metrics", lambda _: PlainTextResponse("")),
        ])  # fmt: skip
        self.server = ThreadedServer(app, port=free_port(), name="lockstep-engine")
        self.server.start()

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "toy", "max_model_len": 4096}]})

    async def completions(self, request: Request) -> Response:
        await request.body()

        async def pieces() -> Any:
            for i, piece in enumerate(PIECES):
                if i and not await anyio.to_thread.run_sync(self.read.acquire, True, HANG):
                    return  # the client never had the piece before: the reply ends short
                yield piece

        return StreamingResponse(pieces(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def engine() -> Iterator[LockstepEngine]:
    lockstep = LockstepEngine()
    yield lockstep
    lockstep.server.stop()


def _spawn(service: str, *flags: str, prelude: str = "") -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    extra = {"node": NODE, "router": []}.get(service, ["--chunk-size", "16"])
    code = f"{prelude}import sys; from kvatlas.cli import main; sys.exit(main())"
    args = ["-c", code, service, "--port", str(port), "--log-level", "warning", *extra, *flags]
    return spawn_service(args, f"http://127.0.0.1:{port}"), port


@pytest.fixture(params=["coordinator", "node", "router"])
def service(request: pytest.FixtureRequest) -> Iterator[Spawn]:
    procs: list[subprocess.Popen[bytes]] = []
    base: list[str] = []
    if request.param == "router":  # in front of one engine (it answers /healthz only then)
        url = request.getfixturevalue("engine").server.url
        base = ["--engine", f"e={url}", "--policy", "round-robin"]

    def spawn(*flags: str) -> tuple[subprocess.Popen[bytes], int]:
        proc, port = _spawn(request.param, *base, *flags)
        procs.append(proc)
        return proc, port

    yield spawn, request.param
    stop(procs)


@pytest.fixture(scope="module")
def one_second_guard(request: pytest.FixtureRequest) -> Iterator[Callable[[str], int]]:
    """The port of a process of the named service (started on first use, then shared by this
    module's tests) with 1 s header and body timeouts and no other flags; a test counts its
    own refusals (the increase of the counter)."""
    started: dict[str, tuple[subprocess.Popen[bytes], int]] = {}

    def port_of(name: str) -> int:
        if name not in started:
            base: list[str] = []
            if name == "router":  # in front of one engine (it answers /healthz only then)
                url = request.getfixturevalue("engine").server.url
                base = ["--engine", f"e={url}", "--policy", "round-robin"]
            started[name] = _spawn(
                name, *base, "--http-header-timeout-s", "1", "--http-body-timeout-s", "1"
            )
        proc, port = started[name]
        assert proc.poll() is None, f"the shared {name} exited"
        return port

    yield port_of
    stop([proc for proc, _ in started.values()])


@pytest.fixture(params=["coordinator", "node", "router"])
def guarded(
    request: pytest.FixtureRequest, one_second_guard: Callable[[str], int]
) -> tuple[int, str]:
    """``(port, service)`` of the shared process of each service (:func:`one_second_guard`)."""
    return one_second_guard(request.param), request.param


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    conn.setblocking(False)
    return conn


def _closed_by_server(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` (EOF or reset); what it sent before is read."""
    try:
        while conn.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _wait_closed(conns: list[socket.socket], drip: list[socket.socket] | None = None) -> int:
    """Poll until every connection of ``conns`` was closed by the server (or the hang
    detector's deadline); ``drip``: send one header byte on each of these per round.
    Returns how many were closed."""
    deadline = time.monotonic() + HANG
    closed: set[int] = set()
    while len(closed) < len(conns) and time.monotonic() < deadline:
        for i, conn in enumerate(conns):
            if i not in closed and _closed_by_server(conn):
                closed.add(i)
            elif i not in closed and drip is not None and conn in drip:
                with contextlib.suppress(OSError):
                    conn.send(b"x")
        time.sleep(0.1)
    return len(closed)


def _refused(port: int, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG).text
    found = re.search(rf'kvatlas_http_refused_total{{reason="{reason}"}} (\S+)', text)
    assert found, text[-500:]
    return float(found.group(1))


def _healthy_within(port: int) -> None:
    deadline = time.monotonic() + HANG
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, "the service did not answer again"
        time.sleep(0.1)


def test_half_open_connections_are_closed_after_the_header_timeout(
    guarded: tuple[int, str],
) -> None:
    """20 connections that send nothing and 20 that drip header bytes (one every 0.1 s): all
    closed by the server after the 1 s header timeout, counted, and the service answers."""
    port, _ = guarded
    before = _refused(port, "header_timeout")
    silent = [_connect(port) for _ in range(20)]
    dripping = [_connect(port) for _ in range(20)]
    for conn in dripping:
        conn.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert _wait_closed(silent + dripping, drip=dripping) == 40
    _healthy_within(port)
    assert _refused(port, "header_timeout") - before >= 40
    for conn in silent + dripping:
        conn.close()


def test_stalled_body_gets_408_after_the_body_timeout(guarded: tuple[int, str]) -> None:
    """A body announced as 1000 bytes of which 13 come: 408 after the 1 s body timeout and
    the connection closed (before: held for as long as the client likes)."""
    port, name = guarded
    before = _refused(port, "body_timeout")
    path = {"coordinator": "/events", "node": "/engine/lookup", "router": "/v1/completions"}[name]
    reply = _stalled_body_reply(port, path)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert _refused(port, "body_timeout") - before >= 1


def _stalled_body_reply(port: int, path: str) -> bytes:
    """What a request whose body stops after 13 of its 1000 bytes gets, read to the close."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=HANG) as conn:
        conn.sendall(f'{head}Content-Length: 1000\r\n\r\n{{"batches": ['.encode())
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while part := conn.recv(65536):
                reply += part
    return reply


@pytest.mark.parametrize(
    "request_line",
    [b"get /healthz HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\nContent-Length: -1\r\n"],
)
def test_a_request_the_parser_cannot_read_gets_a_json_400(
    guarded: tuple[int, str], request_line: bytes
) -> None:
    """A request line or header uvicorn's parser cannot read: a 400 with the service's JSON
    error body (the coordinator's and node's ``detail``, the router's OpenAI error), then the
    connection closed — it was uvicorn's ``text/plain`` "Invalid HTTP request received." on
    the coordinator and node (every error a 4xx with a JSON body saying what was wrong)."""
    port, name = guarded
    with socket.create_connection(("127.0.0.1", port), timeout=HANG) as conn:
        conn.sendall(request_line + b"Host: x\r\n\r\n")
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while part := conn.recv(65536):
                reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), reply[:300]
    assert b"content-type: application/json" in head.lower().split(b"\r\n"), head
    error = json.loads(body)
    message = error["error"]["message"] if name == "router" else error["detail"]
    assert "Invalid HTTP request" in message


def test_the_routers_408_is_an_openai_error(one_second_guard: Callable[[str], int]) -> None:
    """docs/router.md, "Endpoints": errors the router raises itself are OpenAI error objects;
    its guard's 408 was the coordinator's ``{"detail": ...}``. The coordinator's and node's
    408 keep their ``detail`` (``test_answer_in_turn.py``)."""
    reply = _stalled_body_reply(one_second_guard("router"), "/v1/completions")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), reply[:300]
    assert b"content-type: application/json" in head.lower().split(b"\r\n"), head
    error = json.loads(body)["error"]
    assert (error["code"], error["type"], error["param"]) == (408, "RequestTimeoutError", None)
    assert "not received in time" in error["message"]


def test_connections_beyond_the_cap_are_closed_at_once(service: Spawn) -> None:
    """A cap of 50 and 60 connections: the 10 beyond are closed when accepted, the 50 stay
    (until the header timeout, 30 s here); once ours are gone the service answers."""
    _, port = service[0]("--http-max-connections", "50", "--http-header-timeout-s", "30")
    conns = [_connect(port) for _ in range(60)]
    deadline = time.monotonic() + HANG
    closed: list[socket.socket] = []
    while len(closed) < 10 and time.monotonic() < deadline:
        closed = [c for c in conns if _closed_by_server(c)]
        time.sleep(0.1)
    time.sleep(0.5)  # none more: the others are held
    assert len([c for c in conns if _closed_by_server(c)]) == 10
    for conn in conns:
        conn.close()
    _healthy_within(port)
    assert _refused(port, "over_cap") >= 10


def test_the_router_streams_each_piece_as_it_comes_under_the_guard(
    engine: LockstepEngine, one_second_guard: Callable[[str], int]
) -> None:
    """Negative control of the router under the guard (tight timeouts, the writes of a loop
    turn joined): a streamed completion arrives piece by piece, each read whole before the
    engine sends the next, and then ends — a piece held back until the reply's end would never
    arrive (the engine waits for it to be read)."""
    engine.read = threading.Semaphore(0)
    port = one_second_guard("router")  # in front of ``engine``
    body = {"model": "toy", "prompt": [1, 2, 3], "stream": True}
    url = f"http://127.0.0.1:{port}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=HANG) as reply:
        assert reply.status_code == 200
        chunks = reply.iter_raw()
        for piece in PIECES:
            got = b""
            while not got.endswith(b"\n\n"):  # one piece may come in several reads
                got += next(chunks)
            assert got == piece
            engine.read.release()  # the next piece only now
        assert next(chunks, b"") == b""


def test_snapshots_keep_working_with_connections_at_the_cap(tmp_path: Path) -> None:
    """A coordinator whose file limit is 128 (the default cap is then 64) and 150 idle
    connections: snapshots every 0.2 s go on being written, none fails with "Too many open
    files" (without the cap, the connections take every descriptor)."""
    snap = tmp_path / "d.snap"
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)); "
    proc, port = _spawn(
        "coordinator", "--snapshot-path", str(snap), "--snapshot-interval", "0.2",
        "--http-header-timeout-s", "60", prelude=prelude,
    )  # fmt: skip
    try:
        conns = [_connect(port) for _ in range(150)]
        written = snap.stat().st_mtime_ns if snap.exists() else 0
        seen = 0
        deadline = time.monotonic() + HANG
        while seen < 3 and time.monotonic() < deadline:
            now = snap.stat().st_mtime_ns if snap.exists() else 0
            if now != written:
                seen, written = seen + 1, now
            time.sleep(0.1)
        for conn in conns:
            conn.close()
        _healthy_within(port)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG).text
        assert "kvatlas_snapshot_failures_total 0.0" in text, re.findall(
            r"kvatlas_snap\S+ \S+", text
        )
        assert seen == 3
        assert _refused(port, "over_cap") >= 150 - 64 - 5
    finally:
        stop([proc])


def test_an_idle_connection_is_kept_for_the_header_timeout(engine: LockstepEngine) -> None:
    """``--http-header-timeout-s`` is the time a client has to send its next request after a
    reply (docs/router.md, docs/coordinator.md): with 8 s, a request sent 6.5 s after the last
    reply on the same connection is answered. uvicorn's own keep-alive closed every idle
    connection after 5 s whatever the flag (a client pool that keeps connections longer, as
    aiohttp's 15 s, then meets a closed one)."""
    url = engine.server.url
    base = {"router": ["--engine", f"e={url}", "--policy", "round-robin"]}
    started = {
        name: _spawn(name, *base.get(name, []), "--http-header-timeout-s", "8")
        for name in ("coordinator", "node", "router")
    }
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        conns = {}
        for name, (_proc, port) in started.items():
            conns[name] = socket.create_connection(("127.0.0.1", port), timeout=HANG)
            conns[name].sendall(request)
            assert conns[name].recv(65536).startswith(b"HTTP/1.1 200 "), name
        time.sleep(6.5)  # idle: past uvicorn's 5 s, within the 8 s the flag gives
        for name, conn in conns.items():
            conn.sendall(request)
            assert conn.recv(65536).startswith(b"HTTP/1.1 200 "), f"{name}: closed when idle"
            conn.close()
    finally:
        stop([proc for proc, _port in started.values()])
