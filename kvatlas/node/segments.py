"""Blend segments: merge the local and fleet matches, cut at the prefix, resolve overlaps.

A blend lookup yields raw matches ("chunk X occurs at request position p") from two legs: the
node's own fragment index and the coordinator's. This module turns them into the segments a
request will actually reuse (the blend lookup in ``docs/node.md``):

1. :func:`merge_union` — the **union** of both legs. The fleet index is best-effort (a dropped
   flush or an evicted token binding can hide a chunk this node holds), so recall must never be
   worse than either leg alone.
2. :func:`filter_prefix` — what the prefix lookup already covers is not fetched twice: keep
   matches at or after ``prefix_len``; a match straddling it is trimmed to what lies after it
   (if the data plane can slice a chunk) or dropped.
3. :func:`resolve_overlaps` — matches may overlap in the request; pick a non-overlapping set,
   **leftmost-greedy** (optimal for equal-length matches), optionally placement-aware.

Fleet and local matches become the same :class:`Segment` objects, so they share one retrieval
path.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, Literal

from kvatlas.api.engine import WireSegment
from kvatlas.keys import BlendMatch, leftmost_greedy

Source = Literal["local", "fleet", "both"]
SOURCES: Final = ("local", "fleet", "both")


class FetchCost(IntEnum):
    """Where a chunk's KV would be fetched from, cheapest first (lower = cheaper).

    Used as a segment's ``cost`` rank; any int works, these are the conventional values. (Not
    to be confused with :class:`kvatlas.directory.Placement`, a record of who holds a key.)"""

    LOCAL_L1 = 0
    PEER_L1 = 1
    SHARED_L2 = 2
    UNKNOWN = 3


@dataclass(frozen=True, slots=True)
class Candidate:
    """A match after the union: one per (chunk_hash, cur_st), tagged with which leg(s) saw it."""

    chunk_hash: bytes
    old_st: int
    cur_st: int
    source: Source


@dataclass(frozen=True, slots=True)
class Segment:
    """A part of a cached chunk that a request reuses.

    Position fields (``C`` = chunk size, chunk token ``i`` in ``[0, C)``):

    - ``old_st``: where the *whole chunk* was stored (token ``i`` was computed at
      ``old_st + i``). Never changed by trimming.
    - ``trim``: leading chunk tokens dropped because the prefix already covers them.
    - ``cur_st``: request position of the first **used** token (chunk token ``trim``).
    - ``length``: number of used tokens (``C - trim`` for a full chunk).

    Retrieval slices the chunk's KV along the token axis with :attr:`kv_slice`
    (``[trim : trim + length]``) and places it at request positions
    ``[cur_st, cur_st + length)``. Every used token moves by the same shift, so re-RoPE is one
    rotation by :attr:`delta` ``= chunk_cur_st − old_st`` where :attr:`chunk_cur_st`
    ``= cur_st − trim`` is where the whole chunk would start in the request.

    ``cost`` ranks where the KV would come from (:class:`FetchCost`; lower = cheaper); it only
    matters to ``resolve_overlaps(prefer_cheaper=True)`` and to tie-breaks.
    """

    chunk_hash: bytes
    old_st: int
    cur_st: int
    length: int
    source: Source
    cost: int = FetchCost.UNKNOWN
    trim: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.length < 1 or self.trim < 0 or self.old_st < 0 or self.cur_st < self.trim:
            raise ValueError(
                "segment needs length >= 1, trim >= 0, old_st >= 0, cur_st >= trim; got "
                f"length={self.length} trim={self.trim} old_st={self.old_st} "
                f"cur_st={self.cur_st}"
            )

    @property
    def end(self) -> int:
        """One past the last request position this segment covers."""
        return self.cur_st + self.length

    @property
    def chunk_cur_st(self) -> int:
        """Request position where the chunk's token 0 would sit (before trimming)."""
        return self.cur_st - self.trim

    @property
    def delta(self) -> int:
        """Re-RoPE shift for every used token: stored at ``old_st + i``, used at
        ``chunk_cur_st + i``."""
        return self.chunk_cur_st - self.old_st

    @property
    def kv_slice(self) -> slice:
        """The used part of the chunk's KV along its token axis."""
        return slice(self.trim, self.trim + self.length)


def merge_union(local: Iterable[BlendMatch], fleet: Iterable[BlendMatch]) -> list[Candidate]:
    """Union of both legs keyed by ``(chunk_hash, cur_st)``, ascending by ``(cur_st,
    chunk_hash)``.

    A match seen by both legs is one candidate with source ``"both"``. Its ``old_st`` is the
    local leg's: the chunk_hash is a prefix-chain hash, so both legs should agree, and if they
    ever do not, the node's own index describes the KV it stored itself. Duplicates within one
    leg collapse to their first occurrence.
    """
    merged: dict[tuple[bytes, int], Candidate] = {}
    for m in local:
        key = (m.chunk_hash, m.cur_st)
        if key not in merged:
            merged[key] = Candidate(m.chunk_hash, m.old_st, m.cur_st, "local")
    for m in fleet:
        key = (m.chunk_hash, m.cur_st)
        seen = merged.get(key)
        if seen is None:
            merged[key] = Candidate(m.chunk_hash, m.old_st, m.cur_st, "fleet")
        elif seen.source == "local":
            merged[key] = Candidate(seen.chunk_hash, seen.old_st, seen.cur_st, "both")
    return sorted(merged.values(), key=lambda c: (c.cur_st, c.chunk_hash))


def filter_prefix(
    candidates: Iterable[Candidate], prefix_len: int, chunk_size: int, allow_trim: bool
) -> list[Segment]:
    """Segments for the candidates that lie beyond the prefix coverage, in input order.

    ``cur_st >= prefix_len`` → a whole-chunk segment. A candidate straddling the boundary
    (``cur_st < prefix_len < cur_st + chunk_size``) becomes a segment of its last
    ``cur_st + chunk_size − prefix_len`` tokens with ``trim = prefix_len − cur_st`` when
    ``allow_trim`` (the data plane can slice a chunk), else it is dropped. Anything wholly
    inside the prefix is dropped: the prefix path already loads those tokens.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out: list[Segment] = []
    for c in candidates:
        if c.cur_st >= prefix_len:
            out.append(Segment(c.chunk_hash, c.old_st, c.cur_st, chunk_size, c.source))
        elif allow_trim and c.cur_st + chunk_size > prefix_len:
            trim = prefix_len - c.cur_st
            out.append(
                Segment(c.chunk_hash, c.old_st, prefix_len, chunk_size - trim, c.source, trim=trim)
            )
    return out


def _leftmost_key(s: Segment) -> tuple[int, int, int, bytes, int, int]:
    """Earlier start first; at equal starts the longer, then the cheaper, then a stable
    order by hash (and stored position) so the choice never depends on input order."""
    return (s.cur_st, -s.length, s.cost, s.chunk_hash, s.old_st, SOURCES.index(s.source))


def _cheapest_key(s: Segment) -> tuple[int, int, int, int, bytes, int, int]:
    """Lowest cost first; equal costs fall back to the leftmost-greedy order."""
    return (s.cost, *_leftmost_key(s))


def resolve_overlaps(
    candidates: Iterable[Segment], *, prefer_cheaper: bool = False
) -> list[Segment]:
    """A non-overlapping subset of ``candidates``, ascending by ``cur_st``.

    **Leftmost-greedy** (default): scan in ``(cur_st, longer, cheaper, chunk_hash)`` order and
    keep a segment iff it starts at or after the end of the last kept one. Guarantees:

    - output sorted and pairwise disjoint; every dropped candidate overlaps a kept one (the
      result is maximal: no candidate could be added);
    - for **equal-length** candidates (whole chunks, no trimming) it keeps the maximum number
      of disjoint segments, hence covers the maximum number of tokens: with equal lengths the
      earliest start is also the earliest end, and earliest-end-first is the classic optimal
      interval-scheduling greedy. With mixed lengths (trimmed segments) it is not necessarily
      optimal.

    **prefer_cheaper=True** (placement-aware): repeat — let ``L`` be the segment plain
    leftmost-greedy would keep next (first in the order above among those starting at or after
    the current frontier); among the remaining segments that overlap ``L`` (``L`` included,
    i.e. those starting before ``L.end``) keep the one with the lowest ``cost`` (ties: the
    leftmost-greedy order, so ``L`` itself wins a tie); move the frontier to its end. Then a
    fill pass adds, in leftmost-greedy order, any dropped segment that overlaps nothing kept
    (only possible with mixed lengths). Guarantees:

    - output sorted, pairwise disjoint and maximal (as above);
    - each pick costs no more than the leftmost-greedy segment ``L`` it displaces;
    - with all costs equal it returns exactly the leftmost-greedy result;
    - for equal-length candidates it keeps at least ``ceil(opt / 2)`` segments, i.e. at
      least half the tokens leftmost-greedy covers. Proof sketch: every optimal segment
      overlaps some pick (it starts at or after ``L``, so with equal lengths it ends after
      ``L.end``, which exceeds the pick's start), and one pick overlaps at most two disjoint
      equal-length segments. The bound is tight: for ``[0, C)`` (expensive),
      ``[C−1, 2C−1)`` (cheap), ``[C, 2C)`` (expensive) it keeps one segment where two fit.
      It trades coverage for cheaper placement by design; use the default when coverage
      matters more than fetch cost.
    """
    ordered = sorted(candidates, key=_leftmost_key)
    if not prefer_cheaper:
        kept = leftmost_greedy([s.cur_st for s in ordered], [s.end for s in ordered])
        return [ordered[k] for k in kept]
    return _resolve_cheaper(ordered)


def _resolve_cheaper(ordered: Sequence[Segment]) -> list[Segment]:
    picked: list[int] = []
    i, n = 0, len(ordered)
    while i < n:
        leftmost = ordered[i]
        best = i
        j = i + 1
        while j < n and ordered[j].cur_st < leftmost.end:
            if _cheapest_key(ordered[j]) < _cheapest_key(ordered[best]):
                best = j
            j += 1
        picked.append(best)
        frontier = ordered[best].end
        i = best + 1
        while i < n and ordered[i].cur_st < frontier:
            i += 1
    kept = [ordered[k] for k in picked]
    if len(kept) == len(ordered):
        return kept
    # Fill pass: with mixed lengths a short segment can lie wholly before the pick that
    # displaced it; add anything that still fits so the result stays maximal.
    chosen = set(picked)
    starts = [s.cur_st for s in kept]
    for k, s in enumerate(ordered):
        if k in chosen:
            continue
        pos = bisect.bisect_right(starts, s.cur_st)
        if (pos == 0 or kept[pos - 1].end <= s.cur_st) and (
            pos == len(kept) or s.end <= kept[pos].cur_st
        ):
            kept.insert(pos, s)
            starts.insert(pos, s.cur_st)
    return kept


def segment_to_wire(seg: Segment) -> WireSegment:
    """A segment as the engine API sends it."""
    return WireSegment(
        seg.chunk_hash.hex(), seg.old_st, seg.cur_st, seg.length, seg.source, int(seg.cost),
        seg.trim,
    )  # fmt: skip


def segment_of(wire: WireSegment) -> Segment:
    """A decoded wire segment as the node's :class:`Segment` (``ValueError`` if invalid)."""
    return Segment(
        bytes.fromhex(wire.chunk_hash), wire.old_st, wire.cur_st, wire.length,
        wire.source, wire.cost, wire.trim,  # type: ignore[arg-type]  # checked by Segment
    )  # fmt: skip
