"""The blend index counts its false candidates (``/metrics``:
``kvatlas_blend_false_probes_total``): (window, content) pairs its anchors proposed whose
claimed content differs from the window, checked against the same anchors worked out by brute
force (every window's leftmost least k-gram, every content's anchor)."""

from __future__ import annotations

import numpy as np
import pytest

from kvatlas.directory import BlendIndex
from kvatlas.directory.blend.kernels.anchors import kgram_size, query_kgrams
from kvatlas.keys import BlendNamespace

C = 16
NS = BlendNamespace("m", "", 1)


def _hashes(index: BlendIndex, tokens: np.ndarray) -> np.ndarray:
    k = kgram_size(C)
    out = np.empty(len(tokens), np.uint32)
    n = query_kgrams(tokens, k, index._state.anchors.keys, out)
    return out[:n]


def _oracle(index: BlendIndex, contents: list[np.ndarray], q: np.ndarray, stride: int) -> int:
    """Pairs (window, content) whose window holds, at its leftmost least k-gram, the
    content's anchor hash at the content's anchor offset, but not the content."""
    width = C - kgram_size(C) + 1
    hq = _hashes(index, q)
    by_anchor: dict[tuple[int, int], list[np.ndarray]] = {}
    for c in contents:
        hc = _hashes(index, c)
        p = int(np.argmin(hc))  # (numpy's argmin: the first of the least)
        by_anchor.setdefault((int(hc[p]), p), []).append(c)
    minima = {o + int(np.argmin(hq[o : o + width])) for o in range(len(q) - C + 1)}
    false = 0
    for at in sorted(minima):
        for p in range(width):
            o = at - p
            if o < 0 or o + C > len(q) or o % stride:
                continue
            for c in by_anchor.get((int(hq[at]), p), []):
                false += not np.array_equal(q[o : o + C], c)
    return false


@pytest.mark.parametrize("stride", [1, 4])
def test_false_probes_are_the_anchors_false_candidates(stride: int) -> None:
    rng = np.random.default_rng(stride)
    index = BlendIndex(C, probe_stride=stride)
    contents = [rng.integers(0, 1000, C).astype(np.uint32) for _ in range(2000)]
    for i, tokens in enumerate(contents):
        index.add(tokens, i.to_bytes(32, "little"), 0, NS)
    q = rng.integers(0, 1000, 20_000).astype(np.uint32)
    q[C * 10 : C * 11] = contents[5]  # one true hit among the windows
    for i in range(20, 60):  # near misses: a content with its last id changed
        q[C * 2 * i : C * 2 * i + C] = contents[i]
        q[C * 2 * i + C - 1] ^= 1
    matches = index.match(q, NS)
    assert any(m.cur_st == C * 10 for m in matches)
    want = _oracle(index, contents, q, stride)
    assert want > 0  # near misses keep the anchor of most of them
    assert index.false_probes == want
    index.match(q, NS)
    assert index.false_probes == 2 * want  # a counter
