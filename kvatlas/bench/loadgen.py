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


async def _open_loop(
    host: str,
    port: int,
    requests: list[bytes],
    arrivals: list[float],
    connections: int,
) -> tuple[list[float], int]:
    """Send request ``k`` at ``arrivals[k]`` (seconds from the start) on an idle connection,
    whether or not earlier ones were answered; a latency runs from the scheduled arrival, so
    a late send (every connection busy, or the generator itself behind) counts against the
    server, not for it (no coordinated omission)."""
    idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    opened = [await asyncio.open_connection(host, port) for _ in range(connections)]
    for pair in opened:
        idle.put_nowait(pair)
    latencies: list[float] = []
    late = 0

    async def one(k: int, due: float) -> None:
        reader, writer = await idle.get()
        writer.write(requests[k % len(requests)])
        status = await _read_response(reader)
        done = time.perf_counter()
        idle.put_nowait((reader, writer))
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        latencies.append(done - due)

    tasks = []
    start = time.perf_counter()
    for k, at in enumerate(arrivals):
        due = start + at
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -1e-3:
            late += 1
        tasks.append(asyncio.create_task(one(k, due)))
    try:
        await asyncio.gather(*tasks)
    finally:
        for _, writer in opened:
            writer.close()
    return latencies, late


def poisson_arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of ``rate`` per second."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, int(rate * seconds * 1.5) + 16)
    times = np.cumsum(gaps)
    return [float(t) for t in times[times < seconds]]


def run_open_loop(
    host: str,
    port: int,
    requests: list[bytes],
    arrivals: list[float],
    connections: int,
) -> tuple[list[float], int]:
    """Open-loop load: request ``k`` offered at ``arrivals[k]`` over at most ``connections``
    keep-alive connections (opened first); returns the latencies from each scheduled arrival
    and how many were sent more than 1 ms late."""
    return asyncio.run(_open_loop(host, port, requests, arrivals, connections))
