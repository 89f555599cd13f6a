"""BlendCoordinatorClient: fleet fragment lookups that never hurt the serving path.

Submit once, poll on recall: ``submit_match`` returns at once; a bounded pool (``match_concurrency``)
runs the round trips, each bounded by ``request_timeout``. Every failure — refused connection,
timeout, 5xx, garbage — becomes an empty result, never an exception into the caller, because
the node always has its local matcher to fall back on. Results not taken within ``result_ttl``
are dropped so aborted requests cannot grow memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import httpx
import numpy as np

from kvatlas.api import BlendLookupBody, BlendReply, decode
from kvatlas.client.coordinator_client import JSON_HEADERS, auth_headers, encode_tokens_b64
from kvatlas.keys import BlendMatch, BlendNamespace

log = logging.getLogger(__name__)

_EMPTY: list[BlendMatch] = []


def matches_of(raw: bytes, n_tokens: int) -> list[BlendMatch]:
    """A reply's matches, decoded as :class:`kvatlas.api.BlendReply` (a malformed match is an
    error, never trusted: wrong KV) and each inside the query of ``n_tokens``."""
    reply = decode(raw, BlendReply, "reply")
    reply.check_positions(n_tokens)
    return [BlendMatch(bytes.fromhex(m.chunk_hash), m.old_st, m.cur_st) for m in reply.matches]


class FleetMatcher(Protocol):
    """What the node's unified lookup needs from a fleet matcher (HTTP or in-process)."""

    def submit_match(self, request_id: str, tokens: Any, namespace: BlendNamespace) -> None: ...

    def poll_match(self, request_id: str) -> list[BlendMatch] | None: ...

    def take_match(self, request_id: str) -> list[BlendMatch] | None: ...


class _Pending:
    __slots__ = ("deadline", "future", "submitted")

    def __init__(self, future: Future[list[BlendMatch]], submitted: float, deadline: float) -> None:
        self.future = future
        self.submitted = submitted
        self.deadline = deadline


class BlendCoordinatorClient:
    def __init__(
        self,
        url: str,
        *,
        match_concurrency: int = 8,
        request_timeout: float = 1.0,
        result_ttl: float = 30.0,
        max_pending: int = 4096,
        token: str | None = None,
    ) -> None:
        if match_concurrency < 1:
            raise ValueError("match_concurrency must be >= 1")
        self.url = url.rstrip("/")
        self.request_timeout = request_timeout
        self.result_ttl = result_ttl
        self.max_pending = max_pending
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(request_timeout),
            headers=auth_headers(token),
            limits=httpx.Limits(max_connections=match_concurrency),
        )
        self._pool = ThreadPoolExecutor(
            max_workers=match_concurrency, thread_name_prefix="kvatlas-blend"
        )
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self.failures = 0
        self.dropped = 0
        self.expired = 0

    @classmethod
    def maybe_create(cls, url: str | None, **kwargs: Any) -> BlendCoordinatorClient | None:
        """``None`` for an empty URL: the node then matches locally only."""
        return cls(url, **kwargs) if url else None

    def submit_match(self, request_id: str, tokens: Any, namespace: BlendNamespace) -> None:
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            if request_id in self._pending:
                return  # submit once
            if len(self._pending) >= self.max_pending:
                self.dropped += 1  # polls of an unknown request answer [] (local-only)
                return
            future = self._pool.submit(self._round_trip, np.array(tokens, copy=True), namespace)
            self._pending[request_id] = _Pending(future, now, now + self.request_timeout)

    def poll_match(self, request_id: str) -> list[BlendMatch] | None:
        """``None`` while pending; the matches, or ``[]`` after any failure or the deadline."""
        with self._lock:
            entry = self._pending.get(request_id)
        if entry is None:
            return []
        if entry.future.done():
            return entry.future.result()
        if time.monotonic() > entry.deadline:
            return []
        return None

    def take_match(self, request_id: str) -> list[BlendMatch] | None:
        """Like :meth:`poll_match`, and forgets the request once it has an answer."""
        result = self.poll_match(request_id)
        if result is not None:
            with self._lock:
                entry = self._pending.pop(request_id, None)
            if entry is not None and not entry.future.done():
                entry.future.cancel()
        return result

    def pending_count(self) -> int:
        with self._lock:
            self._expire_locked(time.monotonic())
            return len(self._pending)

    def _expire_locked(self, now: float) -> None:
        while self._pending:
            request_id, entry = next(iter(self._pending.items()))
            if now - entry.submitted <= self.result_ttl:
                break
            del self._pending[request_id]
            entry.future.cancel()
            self.expired += 1

    def _round_trip(
        self, tokens: np.ndarray[Any, Any], namespace: BlendNamespace
    ) -> list[BlendMatch]:
        try:
            body = BlendLookupBody(
                tokens_b64=encode_tokens_b64(tokens),
                model_name=namespace.model_name,
                world_size=namespace.world_size,
                cache_salt=namespace.cache_salt,
            )
            response = self._http.post(
                "/directory/blend-lookup", content=body.to_json(), headers=JSON_HEADERS
            )
            if response.status_code != 200:
                raise ValueError(f"status {response.status_code}")
            return matches_of(response.content, len(tokens))
        except Exception as exc:  # best effort: any failure is an empty result
            self.failures += 1
            log.debug("blend lookup failed: %s", exc)
            return _EMPTY

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> BlendCoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
