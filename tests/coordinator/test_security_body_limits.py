"""Issue 25 item 8: each route's body limit is the largest legitimate body *of that route*
(derived from the route's own bounds), and a lookup's token count is enforced while its
tokens are read, never after a list of them was built. Against a real coordinator process
with its default limits and auth on (a salt-bound lookup token, as in the report)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
import pytest

from kvatlas.coordinator.app import route_body_limit
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import free_port
from kvatlas.processes import stop
from tests.coordinator.security_support import (
    bearer,
    peak_rss_bytes,
    raw_request,
    reset_peak_rss,
    spawn_coordinator,
    status_of,
    token,
    write_tokens,
)

LOOKUP_A = token("lookup-a")
MIB = 1 << 20


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """One process for the module: each test resets its peak memory before it reads it."""
    tokens = write_tokens(
        tmp_path_factory.mktemp("limits") / "tokens.json",
        {"token": LOOKUP_A, "role": "lookup", "cache_salts": ["a"]},
    )
    port = free_port()
    proc = spawn_coordinator(port, "--auth-token-file", str(tokens))  # default limits
    yield port, proc.pid
    stop([proc])


def _chunked_upload(
    port: int, path: str, first: bytes, piece: bytes, total: int
) -> tuple[int, bytes]:
    """POST ``first``, then ``piece`` repeated up to ``total`` bytes, with chunked transfer encoding (no
    Content-Length: only a limit applied while reading can stop it). Returns how many bytes
    were sent before the server stopped reading, and its reply."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {LOOKUP_A}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(head + b"%x\r\n%s\r\n" % (len(first), first))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < total:
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
            conn.sendall(b"0\r\n\r\n")
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n\r\n" not in reply:
                part = conn.recv(65536)
                if not part:
                    break
                reply += part
    return sent, reply


def test_lookup_limit_is_the_largest_lookup_not_the_largest_event_batch() -> None:
    config = CoordinatorConfig()
    lookup = route_body_limit("POST", "/directory/lookup", config)
    events = route_body_limit("POST", "/events", config)
    assert lookup < 110 * MIB < events <= config.body_limit
    # a full-context lookup in its widest legitimate form fits: token ids of 10 digits
    widest = 11 * config.max_query_tokens + 1024
    assert widest <= lookup
    assert route_body_limit("POST", "/instances", config) == 64 * 1024
    assert route_body_limit("PUT", "/instances/x/heartbeat", config) < 64 * 1024
    # --max-body-bytes stays a ceiling over every route
    capped = CoordinatorConfig(max_body_bytes=1000)
    assert route_body_limit("POST", "/directory/lookup", capped) == 1000


def test_110_mib_lookup_is_refused_by_its_declared_length(coordinator: tuple[int, int]) -> None:
    """The report: 110 MiB announced to /directory/lookup by a salt-bound lookup token, of
    which 1 MiB is sent. Refused at once (a server that reads the body first waits for the
    other 109 MiB until the hang detector's timeout)."""
    port, _ = coordinator
    reply = raw_request(
        port,
        "POST",
        "/directory/lookup",
        declared=110 * MIB,
        body=b'{"model_name":"m","cache_salt":"a","token_ids":[' + b"1," * (MIB // 2),
        headers=bearer(LOOKUP_A),
    )
    assert status_of(reply) == 413, reply[:300]


def test_110_mib_chunked_lookup_is_cut_at_the_route_limit(coordinator: tuple[int, int]) -> None:
    """Without a Content-Length the body is refused while streaming, once past the lookup
    limit (not the 112 MiB of the largest event batch), and the server's peak memory does not
    grow by the body, let alone by a list of its tokens."""
    port, pid = coordinator
    before = reset_peak_rss(pid)
    first = b'{"model_name":"m","cache_salt":"a","token_ids":['
    sent, reply = _chunked_upload(port, "/directory/lookup", first, b"1," * (MIB // 2), 110 * MIB)
    assert status_of(reply) == 413, reply[:300]
    assert sent < 60 * MIB, sent
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
    grown = peak_rss_bytes(pid) - before
    assert grown < 150 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB"


def test_token_count_is_enforced_while_reading_the_tokens(coordinator: tuple[int, int]) -> None:
    """A body within the lookup limit that holds 5x --max-query-tokens one-digit token ids:
    refused with 413 naming the limit, without a Python int per token (a list of 10M ints is
    80 MiB of pointers alone; the kept tokens are 4 bytes each)."""
    port, pid = coordinator
    n = 5 * CoordinatorConfig().max_query_tokens
    body = b'{"model_name":"m","cache_salt":"a","token_ids":[' + b"1," * (n - 1) + b"1]}"
    before = reset_peak_rss(pid)
    r = httpx.post(
        f"http://127.0.0.1:{port}/directory/lookup",
        content=body,
        headers={**bearer(LOOKUP_A), "content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code == 413, r.text
    assert "max-query-tokens" in r.json()["detail"]
    grown = peak_rss_bytes(pid) - before
    assert grown < 60 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB"
