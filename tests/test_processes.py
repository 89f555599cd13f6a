"""Starting services as processes: a port handed out free and then answered by someone else is
not taken for the service having come up."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas import processes
from kvatlas.asgi_thread import free_port
from kvatlas.processes import (
    Interrupted,
    listens,
    sigterm_as_interrupt,
    spawn_service,
    spawn_services,
    stop,
    wait_until_up,
)

HEALTHY_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def someone_else() -> Iterator[str]:
    """A server in this test's process answering ``/healthz`` on a port."""
    server = http.server.HTTPServer(("127.0.0.1", free_port()), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_ports_handed_out_by_one_process_are_distinct() -> None:
    # the kernel offers a closed probe's port again at random: 3,000 picks from its ≈28k
    # ephemeral ports repeat one about 150 times
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_a_service_is_not_up_while_another_process_answers_its_port(someone_else: str) -> None:
    sleeper = ["-c", "import time; time.sleep(60)"]  # never binds the port
    with pytest.raises(RuntimeError, match="did not come up"):
        spawn_service(sleeper, someone_else, timeout=2)


def test_a_service_that_binds_its_port_is_up() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn_service(["-c", HEALTHY_SERVER, str(port)], url, timeout=30)
    try:
        assert listens(proc.pid, url)
    finally:
        stop([proc])


def test_stop_kills_a_process_that_outlives_its_sigterm() -> None:
    """A process that ignores SIGTERM is killed once ``timeout`` has passed, and every process
    given is waited for: none outlives :func:`stop`, whatever the first one does."""
    stubborn = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(120)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]),
    ]
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline() == b"ready\n"
        stop(procs, timeout=1.0)
        assert [p.returncode for p in procs] == [-9, -15]  # SIGKILL after the wait, SIGTERM
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_waiting_for_a_service_polls_on_one_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """Polling builds one HTTP client, not one per poll (each costs ≈60 ms of CPU on a busy
    machine: taken from the process being waited for)."""
    made: list[object] = []
    real_init = httpx.Client.__init__

    def counted(self: httpx.Client, *args: object, **kwargs: object) -> None:
        made.append(self)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx.Client, "__init__", counted)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stuck = wait_until_up([sleeper], [f"http://127.0.0.1:{free_port()}"], timeout=1.0)
    finally:
        stop([sleeper])
    assert stuck == 0 and len(made) == 1


def test_services_that_fail_to_start_are_killed_and_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One exits at once, the other never answers: both are killed and waited for (their
    exit status collected, no zombie left behind)."""
    started: list[subprocess.Popen[bytes]] = []
    real_start = processes._start

    def recorded(*args: Any) -> Any:
        one = real_start(*args)
        started.append(one.proc)
        return one

    monkeypatch.setattr(processes, "_start", recorded)
    services = [
        (["-c", "import time; time.sleep(60)"], f"http://127.0.0.1:{free_port()}"),
        (["-c", "raise SystemExit(3)"], f"http://127.0.0.1:{free_port()}"),
    ]
    try:
        with pytest.raises(RuntimeError, match="did not come up"):
            spawn_services(services, timeout=30)
        assert [p.returncode for p in started] == [-9, 3]  # set only once reaped
    finally:
        stop(started)


def test_a_service_that_exits_says_why_in_the_error() -> None:
    """A quiet service's output is not thrown away when it fails to start: the error carries
    its exit status and the end of what it printed (a suite's start-up failure says why)."""
    dies = ["-c", "import sys; print('x' * 9000); sys.exit('port 1234 is taken')"]
    with pytest.raises(RuntimeError) as raised:
        spawn_service(dies, f"http://127.0.0.1:{free_port()}", timeout=30)
    message = str(raised.value)
    assert "exited with status 1" in message and message.endswith("port 1234 is taken\n")
    assert 4_000 <= len(message) < 4_500  # the end of its output, not all of it


def test_a_service_that_hangs_shows_its_stacks_in_the_error() -> None:
    """One still running when the wait ends is sent SIGABRT first: the error shows where each
    of its threads was (here, a function named after what it waits for)."""
    hangs = ["-c", "import time\ndef importing_forever():\n    time.sleep(60)\nimporting_forever()"]
    with pytest.raises(RuntimeError) as raised:
        spawn_service(hangs, f"http://127.0.0.1:{free_port()}", timeout=2)
    message = str(raised.value)
    assert "no answer in 2 s" in message and "importing_forever" in message


def test_a_logged_service_that_fails_names_its_log(tmp_path: Path) -> None:
    log = tmp_path / "service.log"
    with pytest.raises(RuntimeError, match=f"its output is in {log}"):
        spawn_service(["-c", "print('bye')"], f"http://127.0.0.1:{free_port()}", log=log)
    assert log.read_text() == "bye\n"


def test_services_interrupted_while_they_come_up_are_killed_and_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C (or SIGTERM under ``sigterm_as_interrupt``) during the wait: the services
    already started do not outlive the caller."""
    started: list[subprocess.Popen[bytes]] = []

    def interrupted(procs: list[subprocess.Popen[bytes]], *args: Any) -> int | None:
        started.extend(procs)
        raise KeyboardInterrupt

    monkeypatch.setattr(processes, "wait_until_up", interrupted)
    services = [(["-c", "import time; time.sleep(60)"], f"http://127.0.0.1:{free_port()}")] * 2
    try:
        with pytest.raises(KeyboardInterrupt):
            spawn_services(services, timeout=30)
        assert len(started) == 2 and [p.returncode for p in started] == [-9, -9]
    finally:
        stop(started)


def test_sigterm_unwinds_like_ctrl_c_and_is_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as raised, sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler runs at the next bytecode)
    assert raised.value.signum == signal.SIGTERM
    assert isinstance(raised.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is before


def _listening_children(pid: int) -> list[int]:
    """``pid``'s children that listen on a TCP port (a service that bound its socket)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening.add(f"socket:[{fields[9]}]")
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if listening & processes._sockets_of(int(c))]


def test_a_benchmark_stopped_by_sigterm_stops_the_services_it_started() -> None:
    """``kvatlas bench service`` under a service manager's stop (or ``timeout``): Python's
    default SIGTERM ended the bench at once and left its coordinator running."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvatlas.cli", "bench", "service", "--quick", "--lmcache", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not children and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            children = _listening_children(bench.pid)
        assert children, "the bench started no service"
        bench.send_signal(signal.SIGTERM)
        err = bench.communicate(timeout=120)[1].decode()
        left = [pid for pid in children if _running(pid)]
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in children:  # whatever the bench left behind, so a failure leaks nothing
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert left == [], err[-2000:]
    assert bench.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "interrupted; the processes it started are stopped" in err


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is reaped by init, not by us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
