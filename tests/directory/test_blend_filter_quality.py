"""The content filter's false-positive rate, with fingerprints as the index computes them: at
16 bits a content (what the index sizes it to) and 5 bits a key in one 64-bit word, a blocked
Bloom filter lets ≈0.4% of absent keys through. Every false positive costs the match a table
probe, so a filter whose keys crowd into part of its words (a word index read from bits a
fingerprint does not have) passes the recall tests and is only slower: this test says so."""

from __future__ import annotations

import numpy as np

from kvatlas.directory.blend.kernels.filter import filter_add, may_contain, word_shift
from kvatlas.directory.blend.kernels.modhash import MERSENNE61, fingerprint

WORDS = 4096
KEYS = WORDS * 64 // 16  # 16 bits a content
WINDOW = 16
FMASK = (1 << 61) - 1  # the index's default: every bit of the residue


def _fingerprints(rng: np.random.Generator, base: int, count: int) -> list[np.uint64]:
    ids = rng.integers(0, 128_256, (count, WINDOW), dtype=np.uint32)
    return [np.uint64(fingerprint(row, 0, WINDOW, base, FMASK)) for row in ids]


def test_the_filter_lets_through_few_absent_keys() -> None:
    rng = np.random.default_rng(31)
    base = int(rng.integers(2, MERSENNE61 - 1))
    filt = np.zeros(WORDS, np.uint64)
    for fp in _fingerprints(rng, base, KEYS):
        filter_add(filt, fp)
    shift = word_shift(filt)
    absent = _fingerprints(rng, base, 40_000)
    passed = sum(bool(may_contain(filt, fp, shift)) for fp in absent)
    # ≈0.45% measured; with the word index read from the residue as it is (its bits 61..63
    # always zero: an eighth of the words), ≈65%
    assert passed / len(absent) < 0.01
    used = np.count_nonzero(filt) / WORDS
    assert used > 0.95  # every word takes keys (≈98% at 4 keys a word on average)
