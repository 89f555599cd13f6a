"""The fleet benchmark's ceiling against a brute-force oracle on tuples of tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.bench.fleet.ceiling import ceiling_hit_ratio
from kvatlas.workloads import TraceRequest

BS, CHUNK, SHARE = 4, 8, 0.25


def _oracle(prompts: list[list[int]], fragments: bool) -> float:
    prefixes: set[tuple[int, ...]] = set()
    chunks: set[tuple[int, ...]] = set()
    total = reused = 0.0
    for p in prompts:
        n = len(p)
        total += n
        hit = 0
        for k in range(1, (n - 1) // BS + 1) if n else ():
            if tuple(p[: k * BS]) not in prefixes:
                break
            hit = k
        prefixes.update(tuple(p[: k * BS]) for k in range(1, n // BS + 1))
        reused += hit * BS
        if fragments:
            i, taken = hit * BS, 0
            while i + CHUNK <= n:
                if tuple(p[i : i + CHUNK]) in chunks:
                    taken += CHUNK
                    i += CHUNK
                else:
                    i += 1
            reused += taken * (1 - SHARE)
            chunks.update(tuple(p[s : s + CHUNK]) for s in range(0, n - CHUNK + 1, CHUNK))
    return reused / total if total else 0.0


def _requests(prompts: list[list[int]]) -> list[TraceRequest]:
    return [
        TraceRequest(i, float(i), np.array(p, dtype=np.int64), 1) for i, p in enumerate(prompts)
    ]


pieces = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=6), max_size=8),
       st.booleans())  # fmt: skip
def test_the_ceiling_equals_the_brute_force_oracle(
    shape: list[list[tuple[int, int]]], fragments: bool
) -> None:
    """Prompts glued from a few shared pieces (so prefixes and fragments recur at shifted
    offsets), token ids over 16 bits."""
    library = [[200_000 + 1000 * p + j for j in range(12)] for p in range(6)]
    prompts = [[t for piece, n in parts for t in library[piece][:n]] for parts in shape]
    got = ceiling_hit_ratio(_requests(prompts), BS, CHUNK, fragments, SHARE)
    assert abs(got - _oracle(prompts, fragments)) < 1e-12


def test_a_repeated_prompt_reuses_all_but_its_last_block() -> None:
    prompt = list(range(100_000, 100_040))  # 40 tokens: 10 blocks, 9 reusable
    got = ceiling_hit_ratio(_requests([prompt, prompt]), BS, CHUNK, False, SHARE)
    assert got == (9 * BS) / 80


def test_fragments_count_only_when_asked_and_at_their_reused_share() -> None:
    doc = list(range(300_000, 300_016))  # two chunks
    first = [1, 2, 3, *doc]  # stores [1, 2, 3, doc[0:5]] and doc[5:13]
    second = [*doc, 9]  # reuses doc[5:13] at offset 5; stores doc[0:8] and doc[8:16]
    third = [7, 7, *doc]  # doc[0:8] at 2 and doc[8:16] at 10 (doc[5:13] at 7 overlaps)
    prompts = [first, second, third]
    without = ceiling_hit_ratio(_requests(prompts), BS, CHUNK, False, SHARE)
    with_fragments = ceiling_hit_ratio(_requests(prompts), BS, CHUNK, True, SHARE)
    assert without == 0.0  # negative control: no prefix is ever shared
    assert with_fragments == (8 + 16) * (1 - SHARE) / (19 + 17 + 18)
