"""The prefix summary of a lookup: how many leading chunks each holder of the keys' copies
has (what a router needs from a prefix lookup)."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_

from kvatlas.directory.records import KeyPlacements, Placement, PrefixHolder

Holder = tuple["str | None", str, str, bool]


def prefix_summary(results: list[KeyPlacements], world_size: int = 1) -> list[PrefixHolder]:
    """For each holder (instance, or shared pool), how many *leading* chunks it holds on every
    one of the ``world_size`` ranks; ``results`` are chunk-major, rank-minor. Longest first."""
    counts: dict[Holder, int] = {}
    if world_size == 1 and results:
        first = results[0].placements
        if all(map(is_, map(_PLACEMENTS, results), repeat(first))):  # one tuple: a batch's
            counts = dict.fromkeys(_holders(first), len(results))  # keys (a prompt's) share it
            results = []
    alive: set[Holder] | None = None
    holders: dict[int, set[Holder]] = {}  # by placements tuple (``results`` keep each alive)
    last: tuple[int, ...] = ()
    for c in range(len(results) // world_size):
        ranks = results[c * world_size : (c + 1) * world_size]
        shared = tuple(id(r.placements) for r in ranks)
        if shared != last:  # (a chunk whose ranks share the last one's tuples keeps ``alive``)
            last = shared
            held: set[Holder] | None = None
            for r in ranks:
                here = holders.get(id(r.placements))
                if here is None:
                    here = holders[id(r.placements)] = _holders(r.placements)
                held = here if held is None else held & here
            alive = (held or set()) if alive is None else alive & (held or set())
        if not alive:
            break
        for holder in alive:
            counts[holder] = counts.get(holder, 0) + 1
    summary = [PrefixHolder(*holder, chunks=n) for holder, n in counts.items()]
    summary.sort(key=lambda h: (-h.chunks, h.instance_id or "", h.tier, h.backend))
    return summary


def _holders(placements: tuple[Placement, ...]) -> set[Holder]:
    """Who holds these copies: each one's instance (``None``: a shared pool's), tier, backend
    and sharing."""
    return {(None if p.shared else p.instance_id, p.tier, p.backend, p.shared) for p in placements}


_PLACEMENTS = attrgetter("placements")
