"""Statements of docs/security.md that no other test checked (issue 25: every statement of the
page is checked by a test). Real processes and sockets where the statement is about them: a
coordinator over HTTP on loopback, redis-server, a listening socket standing in for Redis."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.kv_events.exposure import StreamExposure
from kvatlas.coordinator.server import announce_security, free_port
from kvatlas.processes import stop
from kvatlas.redis_clients import redis_client
from tests.coordinator.security_support import spawn_coordinator, token, write_tokens

ROOT = Path(__file__).resolve().parents[1]
LOOKUP_A = token("lookup-a")
EMIT = token("emit")
MIB = 1 << 20


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("tokens") / "tokens.json",
        {"token": LOOKUP_A, "role": "lookup", "cache_salts": ["a"]},
        {"token": EMIT, "role": "emit"},
    )
    port = free_port()
    proc = spawn_coordinator(port, "--auth-token-file", str(tokens))
    yield port
    stop([proc])


def _reply_then_eof(port: int, headers: str, declared: int) -> tuple[bytes, bool]:
    """Announce ``declared`` body bytes, send 2 of them; return the reply's head and whether the
    server then closed the connection (the read hits EOF; a kept-alive connection runs into
    the generous hang detector instead)."""
    head = (
        f"POST /directory/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {declared}\r\n{headers}\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head + b"{}")
        reply = b""
        try:
            while True:
                part = conn.recv(65536)
                if not part:
                    return reply, True
                reply += part
        except TimeoutError:
            return reply, False
        except ConnectionResetError:
            return reply, True


@pytest.mark.parametrize(
    ("headers", "declared", "status"),
    [
        ("", 2, 401),  # the whole body sent: only an explicit close ends it
        (f"Authorization: Bearer {EMIT}\r\n", 2, 403),
        (f"Authorization: Bearer {LOOKUP_A}\r\n", 110 * MIB, 413),
    ],
    ids=["401", "403", "413"],
)
def test_a_refusal_closes_the_connection(
    coordinator: int, headers: str, declared: int, status: int
) -> None:
    """docs/security.md, "Authentication before work" and "Each route reads at most its own
    largest legitimate body": a 401/403 and a 413 close the connection (the unread body is
    never drained into a kept-alive connection)."""
    reply, closed = _reply_then_eof(coordinator, headers, declared)
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:200]
    assert b"connection: close" in reply.lower() and closed, reply[:200]


def test_the_coordinator_warns_when_it_binds_beyond_loopback_without_auth(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.INFO, logger="kvatlas.coordinator"):
        announce_security(CoordinatorConfig(host="0.0.0.0"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--auth-token-file" in warnings[0], warnings
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvatlas.coordinator"):
        announce_security(CoordinatorConfig())  # loopback: no warning
        announce_security(CoordinatorConfig(host="0.0.0.0", auth_token_file=tmp_path / "t"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_published_salts_default_to_the_unsalted_one_unless_a_token_is_bound_to_it() -> None:
    assert StreamExposure.choose(None, frozenset({"a"}), None, None).salts == {""}
    assert StreamExposure.choose(None, frozenset({"", "a"}), None, None).salts == frozenset()
    listed = StreamExposure.choose(["", "a"], frozenset({"", "a"}), None, None)
    assert listed.salts == {"", "a"}  # what the operator lists is published


def test_an_open_stream_beyond_loopback_needs_the_operators_word() -> None:
    exposure = StreamExposure.choose(None, frozenset(), None, None)
    with pytest.raises(ValueError, match="--kv-events-publish-unauthenticated"):
        exposure.check_endpoints(["tcp://0.0.0.0:5557"], auth_on=True, allow_open=False)
    exposure.check_endpoints(["tcp://0.0.0.0:5557"], auth_on=True, allow_open=True)
    exposure.check_endpoints(["tcp://127.0.0.1:5557"], auth_on=True, allow_open=False)


def test_redis_refuses_the_acl_file_until_its_passwords_are_set(tmp_path: Path) -> None:
    """docs/security.md, "ACL users": with the `<ROLE>_PASSWORD_SHA256` placeholders in
    place Redis does not start, so no user has a well-known password (the file with the
    placeholders filled in loads: tests/coordinator/test_redis_acl.py)."""
    binary = shutil.which("redis-server")
    assert binary is not None
    args = [binary, "--port", str(free_port()), "--bind", "127.0.0.1", "--save", "",
            "--dir", str(tmp_path), "--aclfile", str(ROOT / "deploy/redis/users.acl")]  # fmt: skip
    try:
        done = subprocess.run(args, capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("redis-server started with the placeholder ACL file")
    assert done.returncode != 0
    assert b"users.acl" in done.stdout + done.stderr


REPLIES = {b"HELLO": b"%1\r\n$5\r\nproto\r\n:3\r\n", b"PING": b"+PONG\r\n"}


def _first_bytes_a_client_sends(make_client: object) -> bytes:
    """What a client sends on connect and for one PING, to a socket answering like Redis."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            while b"PING" not in got:
                part = conn.recv(65536)
                if not part:
                    return
                got.extend(part)
                for name in re.findall(rb"\*\d+\r\n\$\d+\r\n(\w+)", part):  # one reply each
                    conn.sendall(REPLIES.get(name.upper(), b"+OK\r\n"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = make_client(f"redis://127.0.0.1:{port}/0")  # type: ignore[operator]
    try:
        client.ping()
    finally:
        client.close()
        thread.join(10)
        listener.close()
    return bytes(got)


def test_kvatlas_redis_clients_send_no_client_setinfo() -> None:
    """docs/security.md, "ACL users": under the file's users `CLIENT SETINFO` would be a
    NOPERM (Redis >= 7.2) logged per connection, so kvatlas's clients never send it."""
    import redis

    plain = _first_bytes_a_client_sends(lambda url: redis.Redis.from_url(url, socket_timeout=10))
    assert b"SETINFO" in plain.upper()  # control: redis-py announces itself by default
    ours = _first_bytes_a_client_sends(lambda url: redis_client(url, socket_timeout=10))
    assert b"PING" in ours and b"SETINFO" not in ours.upper()


def test_a_node_takes_its_tokens_from_the_environment() -> None:
    """docs/security.md, "Node", "Secrets": ``KVATLAS_COORDINATOR_TOKEN`` and
    ``KVATLAS_PEER_TOKEN`` instead of a flag that shows in the process list."""
    from kvatlas.cli import _build_parser
    from kvatlas.node.config import config_from_args

    layout = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"]
    args = _build_parser().parse_args(["node", *layout])
    env = {"KVATLAS_COORDINATOR_TOKEN": "c" * 40, "KVATLAS_PEER_TOKEN": "p" * 40}
    config = config_from_args(args, env)
    assert config.coordinator_bearer() == "c" * 40 and config.peer_bearer() == "p" * 40
    assert config_from_args(args, {}).coordinator_bearer() is None


def test_a_down_peer_is_skipped_10_s_doubling_up_to_60_s() -> None:
    """docs/security.md, "Fetching side": the down-times a node runs with by default
    (jitter at its maximum: the whole step)."""
    import inspect

    from kvatlas.node.peer_health import PeerHealth
    from kvatlas.node.tiered_fetch import TieredFetch

    down_for = inspect.signature(TieredFetch.__init__).parameters["down_for"].default
    now = [0.0]
    peers = PeerHealth(down_for, clock=lambda: now[0], jitter=lambda: 1.0)
    waits = []
    for _ in range(5):
        start = now[0]
        peers.failed("p", "refused")
        while peers.down("p"):
            now[0] += 0.5
        waits.append(now[0] - start)
    assert waits == [10.0, 20.0, 40.0, 60.0, 60.0]
    peers.succeeded("p")
    assert not peers.down("p")
