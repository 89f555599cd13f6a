"""The blend index counts its filter's false positives (``/metrics``:
``kvatlas_blend_false_probes_total``): windows the filter let through whose fingerprint no
content has, checked against the same filter and fingerprint evaluated window by window."""

from __future__ import annotations

import numpy as np
import pytest

from kvatlas.directory import BlendIndex
from kvatlas.directory.blend.kernels.filter import may_contain, word_shift
from kvatlas.directory.blend.kernels.layout import BlendArrays
from kvatlas.directory.blend.kernels.modhash import fingerprint
from kvatlas.keys import BlendNamespace

C = 16
NS = BlendNamespace("m", "", 1)


def _oracle(index: BlendIndex, contents: list[np.ndarray], q: np.ndarray, stride: int) -> int:
    filt = BlendArrays(*index._state.kernel_arrays).filt
    shift = word_shift(filt)
    base, fmask = index._base, index._fmask
    stored = {int(fingerprint(c, 0, C, base, fmask)) for c in contents}
    false = 0
    for p in range(0, len(q) - C + 1, stride):
        fp = int(fingerprint(q, p, C, base, fmask))
        if may_contain(filt, np.uint64(fp), shift) and fp not in stored:
            false += 1
    return false


@pytest.mark.parametrize("stride", [1, C])  # dense (rolling) and sparse probing
def test_false_probes_are_the_filters_false_positives(stride: int) -> None:
    rng = np.random.default_rng(stride)
    index = BlendIndex(C, probe_stride=stride)
    contents = [rng.integers(0, 1000, C).astype(np.uint32) for _ in range(2000)]
    for i, tokens in enumerate(contents):
        index.add(tokens, i.to_bytes(32, "little"), 0, NS)
    q = rng.integers(0, 1000, 60_000).astype(np.uint32)
    q[C * 10 : C * 11] = contents[5]  # one true hit among the windows
    matches = index.match(q, NS)
    assert any(m.cur_st == C * 10 for m in matches)
    want = _oracle(index, contents, q, stride)
    assert want > 0  # the filter is probabilistic: random windows do get through
    assert index.false_probes == want
    index.match(q, NS)
    assert index.false_probes == 2 * want  # a counter
