"""The request trackers the engine API keeps between the calls of one request.

A tracker is held under ``(principal, request_id)``: the principal (the engine token) that
created it, so a request id is never a capability across tokens — another principal's call
under the same id gets a tracker of its own and never reads, replaces or extends this one.
Within one principal, a call continues the held tracker only if its MM items and salt are the
same and its tokens extend the held ones (generated tokens, appended); any other call under
that id replaces the tracker with one built from its own tokens (never refused: every call is
keyed by its own tokens). See ``docs/node.md`` ("Request ids over the engine API").

Trackers are dropped at the end of a request (store, retrieve, blend-retrieve), after ``ttl``,
beyond ``max_entries`` and beyond ``memory_bytes`` (an estimate per tracker, oldest first); a
tracker larger than the whole budget serves its call and is not kept.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvatlas.auth import Principal
from kvatlas.keys import RequestTracker

log = logging.getLogger(__name__)

_BYTES_PER_TOKEN = 8  # the call's uint32 tokens, held here, and the tracker's own copy
_BYTES_PER_CHUNK = 128  # a chunk hash (32 B) in the tracker's chain, with its list slot
_BYTES_PER_TRACKER = 2048  # the tracker, its chain and this table's entry


def tracker_bytes(n_tokens: int, chunk_size: int) -> int:
    """Estimated memory a held tracker of ``n_tokens`` costs (what the budget counts)."""
    return (
        n_tokens * _BYTES_PER_TOKEN
        + (n_tokens // chunk_size + 1) * _BYTES_PER_CHUNK
        + _BYTES_PER_TRACKER
    )


@dataclass(frozen=True)
class Identity:
    """What a call says its request is: raw tokens (prompt + generated so far), items, salt."""

    tokens: np.ndarray[Any, np.dtype[np.uint32]]
    items: tuple[tuple[str, int, int], ...]
    cache_salt: str

    def continues(self, held: Identity) -> bool:
        """Same items and salt, and these tokens are ``held``'s followed by zero or more others."""
        n = len(held.tokens)
        return (
            self.items == held.items
            and self.cache_salt == held.cache_salt
            and len(self.tokens) >= n
            and bool(np.array_equal(self.tokens[:n], held.tokens))
        )


@dataclass
class _Entry:
    born: float
    tracker: RequestTracker
    identity: Identity
    blend_id: str
    nbytes: int


_Key = tuple[Principal, str]


@dataclass(frozen=True)
class TrackerStats:
    """``/engine/stats`` → ``trackers``: what is held and what was let go, by cause."""

    held: int
    bytes: int
    memory_budget: int
    replaced: int
    expired: int
    evicted: int
    not_kept: int


class Trackers:
    """Trackers of in-flight requests by ``(principal, request_id)`` (see the module
    docstring). ``on_forget`` gets the blend id of each tracker replaced, expired or evicted."""

    def __init__(
        self,
        ttl: float = 120.0,
        max_entries: int = 10_000,
        *,
        memory_bytes: int = 64 * 1024 * 1024,
        chunk_size: int = 256,
        clock: Callable[[], float] = time.monotonic,
        on_forget: Callable[[str], object] = lambda blend_id: None,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.memory_bytes = memory_bytes
        self.chunk_size = chunk_size
        self.replaced = self.expired = self.evicted = self.not_kept = 0
        self._clock = clock
        self._on_forget = on_forget
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> TrackerStats:
        with self._lock:
            return TrackerStats(
                len(self._entries), self._bytes, self.memory_bytes, self.replaced,
                self.expired, self.evicted, self.not_kept,
            )  # fmt: skip

    def get_or_create(
        self,
        owner: Principal,
        request_id: str,
        identity: Identity,
        make: Callable[[], RequestTracker],
    ) -> tuple[RequestTracker, str]:
        """The tracker for this call and the id its blend lookup is polled under (unique per
        tracker, so a replaced request's pending lookup is never answered to its successor)."""
        now = self._clock()
        key = (owner, request_id)
        stale: list[str] = []
        with self._lock:
            while self._entries:
                oldest_key, oldest = next(iter(self._entries.items()))
                if now - oldest.born > self.ttl:
                    self.expired += 1
                elif len(self._entries) >= self.max_entries:
                    self.evicted += 1
                else:
                    break
                stale.append(self._pop(oldest_key).blend_id)
            found = self._entries.get(key)
            if found is not None and identity.continues(found.identity):
                extra = identity.tokens[len(found.identity.tokens) :]
                if len(extra):
                    found.tracker.append_generated(extra.tolist())
                    found.identity = identity
                    self._resize(found, tracker_bytes(len(identity.tokens), self.chunk_size))
                stale.extend(self._fit(keep=key))
                result = found.tracker, found.blend_id
            else:
                if found is not None:
                    self.replaced += 1
                    stale.append(self._pop(key).blend_id)
                    log.info("request id %r reused for other tokens: new tracker", request_id)
                tracker = make()
                result = tracker, f"{request_id}#{next(self._serial)}"
                if request_id:
                    stale.extend(self._keep(key, _Entry(now, tracker, identity, result[1], 0)))
        for old in stale:
            self._on_forget(old)
        return result

    def drop(self, owner: Principal, request_id: str, tracker: RequestTracker) -> None:
        """End of request: forget ``tracker`` (not a newer one that replaced it)."""
        with self._lock:
            found = self._entries.get((owner, request_id))
            if found is not None and found.tracker is tracker:
                self._pop((owner, request_id))

    # ------------------------------------------------------------------ under the lock

    def _pop(self, key: _Key) -> _Entry:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        return entry

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        self._bytes += nbytes - entry.nbytes
        entry.nbytes = nbytes

    def _keep(self, key: _Key, entry: _Entry) -> list[str]:
        nbytes = tracker_bytes(len(entry.identity.tokens), self.chunk_size)
        if nbytes > self.memory_bytes:
            self.not_kept += 1
            return []
        self._entries[key] = entry
        self._resize(entry, nbytes)
        return self._fit(keep=key)

    def _fit(self, keep: _Key) -> list[str]:
        """Evict the oldest entries until the held bytes fit the budget; ``keep`` (the entry
        of the current call) goes last, only when it alone exceeds the budget."""
        stale: list[str] = []
        while self._bytes > self.memory_bytes:
            victim = next((k for k in self._entries if k != keep), keep)
            if victim == keep:
                self.not_kept += 1
            else:
                self.evicted += 1
            stale.append(self._pop(victim).blend_id)
        return stale
