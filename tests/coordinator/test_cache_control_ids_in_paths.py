"""Ids a caller gives the coordinator that it passes on in a node's URL (a prefetch's request
id; a move's hold id) are one path segment there, escaped: a real coordinator process in
front of a socket that records every request line a node would get. Unescaped, an id with
``../`` or ``?`` steered the coordinator (and the node token it sends, an admin one) to
another route of the node, and one with CR/LF was a 500 with a logged traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.client.mp_server_client import MPServerClient, MPServerError
from kvatlas.processes import stop
from tests.helpers import spawn_coordinator


class RecordingNode:
    """Answers every request 404 (JSON) and records its request line."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.lines: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    part = conn.recv(65536)
                    if not part:
                        break
                    data += part
                self.lines.append(data.split(b"\r\n", 1)[0])
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
                             b'Content-Length: 17\r\nConnection: close\r\n\r\n{"detail":"nope"}')  # fmt: skip

    def targets(self, since: int) -> list[bytes]:
        return [line.split(b" ")[1] for line in self.lines[since:]]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[httpx.Client, RecordingNode]]:
    node, port = RecordingNode(), free_port()
    proc = spawn_coordinator(port, "--chunk-size", "16")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        reply = client.post(
            "/instances", json={"instance_id": "n1", "ip": "127.0.0.1", "http_port": node.port}
        )
        assert reply.status_code == 200, reply.text
        yield client, node
    finally:
        client.close()
        stop([proc])
        node.sock.close()


@pytest.mark.parametrize(
    ("asked", "sent"),
    [
        ("..%2F..%2Fcache%2Fobjects%3Ftier%3Dl2", b"..%2F..%2Fcache%2Fobjects%3Ftier%3Dl2"),
        ("a%2Fb", b"a%2Fb"),
        ("%2E%2E", None),  # (a URL resolves it: never a segment; no node has such an id)
        (".", None),
        ("a%0D%0Ab", b"a%0D%0Ab"),
        ("a%20b%23c", b"a%20b%23c"),
    ],
)
def test_a_request_id_is_one_escaped_segment_of_the_nodes_path(
    fleet: tuple[httpx.Client, RecordingNode], asked: str, sent: bytes | None
) -> None:
    client, node = fleet
    before = len(node.lines)
    reply = client.get(f"/cache/prefetches/n1/{asked}")
    assert reply.status_code == 404, reply.text  # the node does not know it
    assert "detail" in reply.json()
    assert node.targets(before) == ([] if sent is None else [b"/cache/prefetches/" + sent])


def test_a_hold_id_is_one_escaped_segment_too() -> None:
    node = RecordingNode()
    with (
        MPServerClient(f"http://127.0.0.1:{node.port}", timeout=5) as mp,
        pytest.raises(MPServerError) as refused,
    ):
        mp.release("../cache/clear?x")
    assert refused.value.reply_status == 404  # the node's
    assert node.targets(0) == [b"/cache/holds/..%2Fcache%2Fclear%3Fx"]
    node.sock.close()
