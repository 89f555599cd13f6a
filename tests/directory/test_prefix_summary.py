"""The prefix summary (how many leading chunks each holder has) against its definition, holder
by holder, on results whose keys share placements tuples (as a lookup's keys of one stored
batch do) and hold equal but distinct ones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyPlacements, Placement, PrefixHolder
from kvatlas.directory.prefixes import prefix_summary
from kvatlas.keys import ObjectKey, pack_kv_rank

KEY = ObjectKey(bytes(32), "m", pack_kv_rank(1, 0, 1, 0))
COPIES = [
    Placement("a", 1, "l1", "dram", 8, False, 0.0),
    Placement("b", 1, "l1", "dram", 8, False, 0.0),
    Placement("a", 1, "l2", "disk", 8, False, 0.0),
    Placement("p", 1, "l2", "redis", 8, True, 0.0),
    Placement("q", 1, "l2", "redis", 8, True, 0.0),  # the same pool, another reporter
]


def reference(results: list[KeyPlacements], world_size: int) -> list[PrefixHolder]:
    """The definition: each holder's count of leading chunks every rank of which it holds."""
    chunks = [
        results[c * world_size : (c + 1) * world_size] for c in range(len(results) // world_size)
    ]

    def holds(holder: tuple[str | None, str, str, bool], r: KeyPlacements) -> bool:
        return any(
            (None if p.shared else p.instance_id, p.tier, p.backend, p.shared) == holder
            for p in r.placements
        )

    everyone = {
        (None if p.shared else p.instance_id, p.tier, p.backend, p.shared)
        for r in results
        for p in r.placements
    }
    summary = []
    for holder in everyone:
        n = 0
        while n < len(chunks) and all(holds(holder, r) for r in chunks[n]):
            n += 1
        if n:
            summary.append(PrefixHolder(*holder, chunks=n))
    return sorted(summary, key=lambda h: (-h.chunks, h.instance_id or "", h.tier, h.backend))


copies = st.lists(st.sampled_from(COPIES), max_size=4, unique=True).map(tuple)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(copies, min_size=1, max_size=4),  # a few tuples, shared by many keys
    st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=40),
    st.integers(1, 3),
)
def test_summary_equals_the_chunk_by_chunk_count(
    groups: list[tuple[Placement, ...]], picks: list[tuple[int, bool]], world_size: int
) -> None:
    """Keys name one of the shared tuples, or (``True``) an equal copy of their own."""
    results = [
        KeyPlacements(KEY, tuple(list(groups[i % len(groups)])) if own else groups[i % len(groups)])
        for i, own in picks
    ]
    assert prefix_summary(results, world_size) == reference(results, world_size)


@settings(max_examples=100, deadline=None)
@given(copies, st.integers(0, 40), st.integers(1, 3))
def test_keys_sharing_one_tuple_are_counted_as_the_chunk_by_chunk_count(
    group: tuple[Placement, ...], n: int, world_size: int
) -> None:
    """A prompt's lookup: every key names the one tuple of its stored batch (counted at once
    for one rank), empty or not."""
    results = [KeyPlacements(KEY, group) for _ in range(n)]
    assert prefix_summary(results, world_size) == reference(results, world_size)
