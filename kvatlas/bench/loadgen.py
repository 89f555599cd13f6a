"""A lean HTTP/1.1 load generator for the service benchmark (keep-alive, pre-encoded requests).

The load generator shares the 2 cores with the server; a general-purpose async client spends
more CPU per request than the server does, so it would mostly measure itself. This one writes
pre-built request bytes and reads responses by Content-Length on persistent connections.
"""

from __future__ import annotations

import asyncio
import time


def build_post(
    host: str, port: int, path: str, body: bytes, content_type: str = "application/json"
) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return head.encode("ascii") + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)
    return status


async def _worker(
    host: str,
    port: int,
    requests: list[bytes],
    offset: int,
    stride: int,
    deadline: float,
    latencies: list[float],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    i = offset
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            writer.write(requests[i % len(requests)])
            status = await _read_response(reader)
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
            latencies.append(time.perf_counter() - start)
            i += stride
    finally:
        writer.close()


def run_load(
    host: str, port: int, requests: list[bytes], clients: int, seconds: float
) -> list[float]:
    """Closed-loop load: ``clients`` connections, each sends its next request when the last
    one is answered, for ``seconds``; returns per-request latencies."""

    async def main() -> list[float]:
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds
        await asyncio.gather(
            *(
                _worker(host, port, requests, k, clients, deadline, latencies)
                for k in range(clients)
            )
        )
        return latencies

    return asyncio.run(main())
