"""Shared by the security tests: token files, a coordinator process, raw-socket requests and
the server's memory, read from /proc (real processes, no wall-clock asserts)."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from tests.helpers import spawn_coordinator, write_tokens

__all__ = ["spawn_coordinator", "write_tokens"]  # written once in tests/helpers.py

ADMIN = "admin-token-" + "a" * 32
EMIT_ANY = "emit-any-token-" + "e" * 32
LOOKUP_ALL = "lookup-all-token-" + "l" * 32


def token(name: str) -> str:
    """A token of 32+ characters named ``name`` (readable in failures)."""
    return f"{name}-" + "x" * 32


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM): it only grows, so a spike cannot hide."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak_rss(pid: int) -> int:
    """Reset the process's peak resident set to what it holds now (Linux ``clear_refs``: 5)
    and return it: a peak read afterwards is this test's, whatever ran before in the process."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return peak_rss_bytes(pid)


def raw_request(
    port: int,
    method: str,
    path: str,
    *,
    declared: int,
    body: bytes,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> bytes:
    """Send a request that announces ``declared`` body bytes and sends only ``body``; return
    what the server answered before closing (``b""`` if it closed without a reply). A server
    that waits for the rest of the body runs into ``timeout`` (socket.timeout): a hang
    detector, generous on a loaded machine, never a latency assertion."""
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {declared}"]
    head += ["Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        # refused and closed before the whole body was sent: read the reply below
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply:
                part = conn.recv(65536)
                if not part:
                    break
                reply += part
        except ConnectionResetError:
            pass
        return reply


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    return int(reply.split(b" ", 2)[1])
