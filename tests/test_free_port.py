"""``free_port`` hands out ports below the kernel's range for outgoing connections: a port
picked there can be given to a client's connection (of this or another process, e.g. a test
on the other worker) before the server it was picked for binds it, and that server then exits
with its port taken (a node that "did not come up" in a full run)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvatlas import asgi_thread
from kvatlas.asgi_thread import LOWEST_PORT, free_port


def test_ports_are_below_the_outgoing_range_distinct_and_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = 32_768  # Linux's default range (this machine's may differ: read from the file)
    linux_default = tmp_path / "ip_local_port_range"
    linux_default.write_text(f"{start}\t60999\n")
    monkeypatch.setattr(asgi_thread, "EPHEMERAL_RANGE", linux_default)
    ports = [free_port() for _ in range(500)]
    assert all(LOWEST_PORT <= p < start for p in ports)
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # free when handed out


def test_without_room_below_the_range_the_kernel_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{LOWEST_PORT + 10}\t60999\n")
    monkeypatch.setattr(asgi_thread, "EPHEMERAL_RANGE", narrow)
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    monkeypatch.setattr(asgi_thread, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert LOWEST_PORT <= free_port() < 32_768  # Linux's default start when unreadable
