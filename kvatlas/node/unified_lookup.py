"""UnifiedBlendLookup: the node's blend lookup — local matcher ∪ fleet index, never worse.

What an engine calls for a blend request (``docs/node.md``):

1. :meth:`UnifiedBlendLookup.start` submits the coordinator query (it runs on the fleet
   client's pool) and then runs the local matcher, so both legs proceed in parallel; it starts
   the wall-clock deadline.
2. :meth:`UnifiedBlendLookup.poll`, after prefix resolution: ``None`` while the fleet answer
   is pending and the deadline has not passed (the engine asks again later); otherwise the
   final :class:`LookupResult`. Past the deadline the fleet leg is given up for this lookup.
3. The result is the union of both legs, cut at the prefix, overlap-resolved
   (:mod:`kvatlas.node.segments`).

Degradation is the point: the fleet index is best-effort, so a coordinator that is down,
slow, erroring or started without blend lookup yields exactly the local-only result — the
fleet client already maps every failure to ``[]``, a deadline bounds the wait, and even a
client that raises is treated as an empty answer.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

from kvatlas.client import FleetMatcher
from kvatlas.keys import BlendMatch, BlendNamespace, as_token_array
from kvatlas.node.segments import Segment, filter_prefix, merge_union, resolve_overlaps

log = logging.getLogger(__name__)


class LocalMatcher(Protocol):
    """The node's local matcher: a ``BlendIndex``, or the node's :class:`Presence` over its
    index, which hands out real chunk hashes and each salt's own offsets."""

    @property
    def chunk_size(self) -> int: ...

    def match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]: ...


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The final answer of one blend lookup.

    - ``segments``: what to reuse, ascending by ``cur_st``, pairwise disjoint, all at or after
      the prefix length.
    - ``local_matches`` / ``fleet_matches``: raw matches from each leg (before the union,
      prefix filter and overlap resolution); ``fleet_only``: union candidates only the fleet
      knew (what the fleet leg added to recall).
    - ``fleet_used``: the fleet answer arrived in time and was merged. A failing coordinator
      looks like an empty answer (the client maps failures to ``[]``), so ``fleet_used`` with
      ``fleet_matches == 0`` is normal. ``False`` without a fleet client or after a timeout.
    - ``fleet_timed_out``: the deadline passed while the fleet answer was pending.
    """

    segments: tuple[Segment, ...]
    local_matches: int
    fleet_matches: int
    fleet_only: int
    fleet_used: bool
    fleet_timed_out: bool

    @property
    def covered_tokens(self) -> int:
        return sum(s.length for s in self.segments)


NOTHING_FOUND: Final = LookupResult(
    segments=(), local_matches=0, fleet_matches=0, fleet_only=0, fleet_used=False,
    fleet_timed_out=False,
)  # fmt: skip
"""The answer for a request that has nothing to look up (no cacheable key)."""


@dataclass(slots=True)
class _Lookup:
    local: list[BlendMatch]
    n_tokens: int
    started: float
    deadline: float
    fleet_key: str | None  # None: no fleet leg for this lookup


class UnifiedBlendLookup:
    """Local matcher and fleet index behind one poll-able lookup; see the module docstring.

    ``allow_trim``: whether a match straddling the prefix boundary may be trimmed to its part
    after the boundary (the retrieval path must then slice ``Segment.kv_slice``); off by
    default, because a data plane that ignores ``trim`` would place KV at the wrong positions.
    ``cost_of`` ranks each candidate's fetch cost (:class:`~kvatlas.node.segments.FetchCost`)
    for ``prefer_cheaper`` and tie-breaks; without it every segment is ``FetchCost.UNKNOWN``.

    Memory stays flat: a lookup is forgotten when ``poll`` returns its final result or on
    ``cancel``; lookups abandoned without either expire after ``result_ttl`` and at most
    ``max_pending`` are held (the oldest is evicted first). A lookup the fleet leg gave up on
    leaves an entry in the fleet client until its answer (or ``[]``) arrives; those are taken
    and discarded on later calls. Each lookup uses its own fleet request key, so a reused
    ``request_id`` can never pick up a stale answer computed for other tokens (wrong KV).

    Thread-safe: one lock guards the bookkeeping and is never held across the local match.
    """

    def __init__(
        self,
        local_index: LocalMatcher,
        fleet: FleetMatcher | None,
        *,
        chunk_size: int,
        deadline_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        prefer_cheaper: bool = False,
        cost_of: Callable[[Segment], int] | None = None,
        allow_trim: bool = False,
        max_pending: int = 4096,
        result_ttl: float = 60.0,
    ) -> None:
        if chunk_size != local_index.chunk_size:
            raise ValueError(
                f"chunk_size {chunk_size} differs from the local index's "
                f"{local_index.chunk_size}: positions from the two legs would not agree"
            )
        if deadline_s < 0 or result_ttl <= 0 or max_pending < 1:
            raise ValueError("need deadline_s >= 0, result_ttl > 0 and max_pending >= 1")
        self.local_index = local_index
        self.fleet = fleet
        self.chunk_size = chunk_size
        self.deadline_s = deadline_s
        self.prefer_cheaper = prefer_cheaper
        self.cost_of = cost_of
        self.allow_trim = allow_trim
        self.max_pending = max_pending
        self.result_ttl = result_ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self._orphans: deque[str] = deque()
        self._serial = itertools.count()
        self.fleet_timeouts = 0
        self.fleet_rejected = 0
        self.expired = 0
        self.evicted = 0

    # ------------------------------------------------------------------ API

    def start(self, request_id: str, tokens: Any, namespace: BlendNamespace) -> None:
        """Submit the fleet query, run the local matcher, start the deadline.

        Once per lookup: a second ``start`` for an active ``request_id`` is a no-op. Invalid
        tokens raise ``ValueError`` before anything is submitted."""
        arr = as_token_array(tokens)
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            if request_id in self._lookups:
                return
            fleet_key = None if self.fleet is None else f"{request_id}#{next(self._serial)}"
        self._sweep_orphans()
        if fleet_key is not None and not self._submit(fleet_key, arr, namespace):
            fleet_key = None
        local = self.local_index.match(arr, namespace)
        entry = _Lookup(local, int(arr.shape[0]), now, now + self.deadline_s, fleet_key)
        with self._lock:
            if request_id in self._lookups:  # a concurrent start won the race
                if fleet_key is not None:
                    self._orphans.append(fleet_key)
                return
            while len(self._lookups) >= self.max_pending:
                _, oldest = self._lookups.popitem(last=False)
                self._abandon_locked(oldest)
                self.evicted += 1
            self._lookups[request_id] = entry

    def poll(self, request_id: str, prefix_len: int) -> LookupResult | None:
        """``None`` = defer (fleet pending, deadline not passed); else the final result.

        The final result forgets the lookup; polling it again raises ``KeyError``, as does a
        ``request_id`` never started, cancelled or expired. A fleet answer that is ready is
        used even if the deadline just passed (it costs no more waiting)."""
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        fleet: list[BlendMatch] | None = None
        timed_out = False
        with self._lock:
            entry = self._lookups.get(request_id)
            if entry is None:
                raise KeyError(
                    f"no active blend lookup {request_id!r} (never started, already "
                    "finalized, cancelled or expired)"
                )
            if entry.fleet_key is not None:
                fleet = self._take(entry.fleet_key)
                if fleet is None:
                    if self._clock() < entry.deadline:
                        return None
                    timed_out = True
                    self.fleet_timeouts += 1
                    self._orphans.append(entry.fleet_key)
            del self._lookups[request_id]
        return self._finish(entry, fleet, timed_out, prefix_len)

    def cancel(self, request_id: str) -> bool:
        """Forget a lookup (aborted request); ``True`` if it was active."""
        with self._lock:
            entry = self._lookups.pop(request_id, None)
            if entry is not None:
                self._abandon_locked(entry)
        return entry is not None

    def pending_count(self) -> int:
        """Active lookups held by this object (fleet-client entries not included)."""
        with self._lock:
            self._expire_locked(self._clock())
            return len(self._lookups)

    def orphan_count(self) -> int:
        """Fleet-client requests given up on and not yet drained."""
        self._sweep_orphans()
        with self._lock:
            return len(self._orphans)

    # ------------------------------------------------------------------ internals

    def _finish(
        self, entry: _Lookup, fleet: list[BlendMatch] | None, timed_out: bool, prefix_len: int
    ) -> LookupResult:
        fleet_ok = self._plausible(fleet or [], entry.n_tokens)
        candidates = merge_union(entry.local, fleet_ok)
        segments = filter_prefix(candidates, prefix_len, self.chunk_size, self.allow_trim)
        if self.cost_of is not None:
            cost_of = self.cost_of
            segments = [replace(s, cost=int(cost_of(s))) for s in segments]
        chosen = resolve_overlaps(segments, prefer_cheaper=self.prefer_cheaper)
        return LookupResult(
            segments=tuple(chosen),
            local_matches=len(entry.local),
            fleet_matches=len(fleet_ok),
            fleet_only=sum(1 for c in candidates if c.source == "fleet"),
            fleet_used=fleet is not None,
            fleet_timed_out=timed_out,
        )

    def _plausible(self, fleet: list[BlendMatch], n_tokens: int) -> list[BlendMatch]:
        """Drop fleet matches that cannot fit in the request: a whole chunk must lie inside
        it. (The local leg verifies tokens itself; a fleet reply is only range-checked by the
        client, and a chunk placed past the end would be wrong KV.)"""
        ok = [m for m in fleet if m.cur_st >= 0 and m.cur_st + self.chunk_size <= n_tokens]
        if len(ok) != len(fleet):
            with self._lock:
                self.fleet_rejected += len(fleet) - len(ok)
        return ok

    def _submit(self, fleet_key: str, arr: Any, namespace: BlendNamespace) -> bool:
        assert self.fleet is not None
        try:
            self.fleet.submit_match(fleet_key, arr, namespace)
        except Exception as exc:  # e.g. a closed client: degrade to local only
            log.warning("blend lookup: fleet submit failed, local only: %s", exc)
            return False
        return True

    def _take(self, fleet_key: str) -> list[BlendMatch] | None:
        assert self.fleet is not None
        try:
            return self.fleet.take_match(fleet_key)
        except Exception as exc:  # the serving path never sees a fleet failure
            log.warning("blend lookup: fleet poll failed, local only: %s", exc)
            return []

    def _abandon_locked(self, entry: _Lookup) -> None:
        if entry.fleet_key is not None:
            self._orphans.append(entry.fleet_key)

    def _expire_locked(self, now: float) -> None:
        while self._lookups:
            request_id, entry = next(iter(self._lookups.items()))
            if now - entry.started <= self.result_ttl:
                break
            del self._lookups[request_id]
            self._abandon_locked(entry)
            self.expired += 1

    def _sweep_orphans(self) -> None:
        """Take (and discard) fleet answers nobody waits for, so the client forgets them
        as soon as they arrive instead of at its TTL."""
        if self.fleet is None:
            return
        with self._lock:
            for _ in range(len(self._orphans)):
                key = self._orphans.popleft()
                if self._take(key) is None:
                    self._orphans.append(key)
