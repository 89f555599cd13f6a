"""Written once for every test module: token files, node configs and layouts, and a process
fleet (coordinator + nodes as real processes on loopback) with its clients."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvatlas.asgi_thread import free_port
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.processes import spawn_service, spawn_services, stop

# ------------------------------------------------------------------ memory maps


def mapping_of(address: int) -> str | None:
    """The line of ``/proc/self/maps`` whose range holds ``address`` (``None``: unmapped)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    return None


# ------------------------------------------------------------------ token files


def write_tokens(path: Path, *entries: dict[str, Any], mode: int = 0o600) -> Path:
    """A token file holding ``entries`` (``{"token", "roles", "instance_ids", ...}``), private
    to its owner unless ``mode`` says otherwise (the services refuse group/world-readable ones)."""
    path.write_text(json.dumps({"tokens": list(entries)}))
    path.chmod(mode)
    return path


# ------------------------------------------------------------------ node configs and layouts

C = 16  # the chunk size of the toy layout
TOY: dict[str, Any] = {
    "model_name": "toy", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "chunk_size": C,
    "dtype": "float32",
}  # fmt: skip
"""The toy layout most tests use: 2 layers, 2 KV heads, head dim 16, chunks of 16, float32."""
TINY: dict[str, Any] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}
"""Override of :data:`TOY` for the smallest layout (one layer, one head, head dim 8)."""


def node_config(**overrides: Any) -> NodeConfig:
    """A node of the :data:`TOY` layout without L2, as the tests build it; ``overrides`` win."""
    return NodeConfig(**{**TOY, "l2": "none", **overrides})


TOY_LAYOUT = node_config().layout


def toy_node_flags(chunk_size: int = C) -> list[str]:
    """The ``kvatlas node`` flags of the :data:`TOY` layout, without L2, logging warnings."""
    return [
        "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
        "--chunk-size", str(chunk_size), "--dtype", "float32", "--l2", "none",
        "--log-level", "warning",
    ]  # fmt: skip


# ------------------------------------------------------------------ process fleets


def spawn_coordinator(port: int, *flags: str) -> subprocess.Popen[bytes]:
    """``kvatlas coordinator`` as a process on ``port`` that answers its health check."""
    return spawn_service(
        ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--log-level", "warning", *flags],
        f"http://127.0.0.1:{port}",
    )


@contextmanager
def process_fleet(
    coordinator_flags: Sequence[str],
    nodes: dict[str, Sequence[str]],
    node_flags: Sequence[str] = (),
    *,
    layout_of: dict[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """A coordinator process, then the ``nodes`` (name → that node's own flags) side by side,
    each a ``kvatlas node`` of the toy layout reporting to the coordinator with ``node_flags``;
    yields ``{"coordinator": url, "layout": layout, "procs": [...], name: NodeEngineClient}``
    and stops every process on the way out."""
    coord_port = free_port()
    coord = f"http://127.0.0.1:{coord_port}"
    layout = node_config(**(layout_of or {})).layout
    procs: list[subprocess.Popen[bytes]] = []
    clients: dict[str, NodeEngineClient] = {}
    try:
        procs.append(spawn_coordinator(coord_port, *coordinator_flags))
        ports = {name: free_port() for name in nodes}
        procs += spawn_services([
            (["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", name,
              *toy_node_flags(layout.chunk_size), *node_flags, "--coordinator-url", coord,
              "--coordinator-event-reporting", *nodes[name]], f"http://127.0.0.1:{port}")
            for name, port in ports.items()
        ])  # fmt: skip
        for name, port in ports.items():
            clients[name] = NodeEngineClient(f"http://127.0.0.1:{port}", layout)
        yield {"coordinator": coord, "layout": layout, "procs": procs, **clients}
    finally:
        for client in clients.values():
            client.close()
        stop(procs)


# ------------------------------------------------------------------ raw HTTP/1.1 exchanges


def exchange(
    port: int,
    wire: bytes,
    cuts: list[int],
    count: int,
    *,
    linger: float = 0.0,
    pause: float = 0.0,
) -> tuple[list[tuple[bytes, bytes]], bool]:
    """Send ``wire`` (requests as raw bytes) cut at ``cuts`` on one connection to ``port`` (a
    server closing on the way ends the sending; ``pause`` seconds between pieces, for the
    server to read each on its own) and read ``count`` replies with a ``Content-Length``,
    each as (head, body), ``100 Continue`` passed over; and whether the server closed the
    connection within ``linger`` seconds after the last."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        at = 0
        for k, cut in enumerate([*sorted(cuts), len(wire)]):
            if k and pause:
                time.sleep(pause)
            try:
                conn.sendall(wire[at:cut])
            except (BrokenPipeError, ConnectionResetError):
                break
            at = cut
        data, out = b"", []
        while len(out) < count:
            while b"\r\n\r\n" not in data:
                part = conn.recv(65536)
                assert part, f"closed after {len(out)} replies: {data!r}"
                data += part
            head, _, data = data.partition(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 100"):
                continue
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(data) < length:
                data += conn.recv(65536)
            out.append((head, data[:length]))
            data = data[length:]
        if not linger:
            return out, False
        conn.settimeout(linger)
        try:
            return out, conn.recv(1) == b""
        except TimeoutError:
            return out, False
