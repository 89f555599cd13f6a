"""One HTTP POST with a whole-request deadline and a reply size bound: how a node reads from a
peer it cannot trust to be well-behaved.

httpx's timeouts apply per socket operation, so a peer that drips a byte per second holds a
request for as long as it likes; and a reply gathered in parts and joined is copied again
before it is parsed. Here every socket operation (connect, TLS, each write and read, header
bytes included) gets only what is left of one deadline, and the body lands in one buffer,
refused as soon as it would exceed the bound (at once when ``Content-Length`` says so).

The buffer is sized from ``Content-Length`` (a kvatlas peer always sends it); a reply streamed
without one grows its buffer by doubling, never past the bound.
"""

from __future__ import annotations

import math
import ssl
import time
import typing
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import Any, Final

import httpcore
import numpy as np

from kvatlas.errors import Unavailable

DEADLINE: Final = "deadline"
TOO_LARGE: Final = "too_large"
REFUSED: Final = "refused"
UNREACHABLE: Final = "unreachable"

FIRST_BUFFER_BYTES: Final = 16 << 20

_deadline: ContextVar[float] = ContextVar("kvatlas_http_deadline", default=math.inf)


class CallFailed(Unavailable):
    """A bounded call gave up; ``cause`` is :data:`DEADLINE`, :data:`TOO_LARGE`,
    :data:`REFUSED` (a status other than 200) or :data:`UNREACHABLE` (connection or protocol
    trouble)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def _left(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float:
    """The smaller of an operation's own timeout and what is left of the call's deadline."""
    remaining = _deadline.get() - time.monotonic()
    if remaining <= 0:
        raise expired("the call's deadline passed")
    return remaining if timeout is None else min(timeout, remaining)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self._inner.connect_tcp(host, port, left, local_address, socket_options)
        )

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, left, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise CallFailed(UNREACHABLE, "malformed Content-Length") from None
    return None


def _allocate(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError:
        raise CallFailed(TOO_LARGE, f"cannot hold a {nbytes}-byte reply") from None


def _read_body(response: httpcore.Response, max_bytes: int) -> memoryview:
    """The body in one buffer: sized by ``Content-Length``, or (a streamed reply) grown by
    doubling from :data:`FIRST_BUFFER_BYTES` up to ``max_bytes``."""
    length = _content_length(response.headers)
    if length is not None and length > max_bytes:
        raise CallFailed(TOO_LARGE, f"a {length}-byte reply exceeds the bound of {max_bytes}")
    buffer = _allocate(length if length is not None else min(max_bytes, FIRST_BUFFER_BYTES))
    filled = 0
    for part in response.iter_stream():
        end = filled + len(part)
        if end > len(buffer):
            if length is not None or end > max_bytes:
                raise CallFailed(TOO_LARGE, f"the reply exceeds the bound of {max_bytes} bytes")
            grown = _allocate(min(max_bytes, max(end, 2 * len(buffer))))
            grown[:filled] = buffer[:filled]
            buffer = grown
        buffer[filled:end] = np.frombuffer(part, dtype=np.uint8)
        filled = end
    return buffer.data[:filled].toreadonly()


class BoundedClient:
    """POSTs under a deadline and a reply bound (see the module docstring); thread-safe,
    connections are kept alive between calls."""

    def __init__(self, *, max_connections: int = 16) -> None:
        self._pool = httpcore.ConnectionPool(  # TLS context made on first https use
            max_connections=max_connections,
            network_backend=_DeadlineBackend(),
        )

    def post(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str],
        deadline_s: float,
        max_reply_bytes: int,
    ) -> memoryview:
        """The reply body of a 200 (a read-only view of the one buffer it was read into);
        anything else raises :class:`CallFailed`."""
        token = _deadline.set(time.monotonic() + deadline_s)
        timeouts = dict.fromkeys(("connect", "read", "write", "pool"), deadline_s)
        try:
            with self._pool.stream(
                "POST", url, headers=list(headers.items()), content=body,
                extensions={"timeout": timeouts},
            ) as response:  # fmt: skip
                if response.status != 200:
                    raise CallFailed(REFUSED, f"HTTP {response.status}")
                return _read_body(response, max_reply_bytes)
        except httpcore.TimeoutException:
            raise CallFailed(DEADLINE, f"no complete reply within {deadline_s} s") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
                OSError) as exc:  # fmt: skip
            raise CallFailed(UNREACHABLE, f"{type(exc).__name__}: {exc}") from None
        finally:
            _deadline.reset(token)

    def close(self) -> None:
        self._pool.close()
