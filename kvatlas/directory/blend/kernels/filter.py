"""The content filter: a blocked Bloom filter over content fingerprints.

One uint64 word per key, 5 bits set in it. The filter only ever gains bits between rebuilds,
so it has false positives (each costs a table probe) but never a false negative: a window it
rejects holds no stored content. It has at least 2 words, a power of two.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.pointers import helper, inline

_U1 = np.uint64(1)
_M6 = np.uint64(63)


@inline
def mix(fp: Any) -> Any:
    """The bits the filter uses: word index from the top, bit positions from the bottom.

    A fingerprint is a residue modulo 2^61-1 at a secret random base, so its bits are
    already uniform and unpredictable: one shift and xor brings its bits 58..60 to the top of
    the word (61..63, always zero in the residue); the positions come from the bottom 30 bits
    (the residue's bottom 30), disjoint from those the word comes from (up to 2^31 words). No
    multiply mixes them: AVX2 has no 64-bit vector multiply (docs/performance.md).
    Fingerprints of fewer bits (a test's ``_fingerprint_bits``) leave the top bits zero: every
    key in word 0, correct but with more false positives."""
    return fp ^ (fp << np.uint64(3))


@inline
def bloom_mask(mixed: Any) -> Any:
    """The key's 5 bits within its filter word (5 rather than 3: fewer false positives at 16
    bits per content, and every false positive costs table probes)."""
    return (
        (_U1 << (mixed & _M6))
        | (_U1 << ((mixed >> np.uint64(6)) & _M6))
        | (_U1 << ((mixed >> np.uint64(12)) & _M6))
        | (_U1 << ((mixed >> np.uint64(18)) & _M6))
        | (_U1 << ((mixed >> np.uint64(24)) & _M6))
    )


@inline
def bloom_word(mixed: Any, fshift: Any) -> Any:
    """The key's word: the top bits of the mixed fingerprint."""
    return np.int64(mixed >> np.uint64(fshift))


@helper
def word_shift(filt: Any) -> Any:
    """The shift :func:`bloom_word` takes for this filter (64 - log2 of its word count)."""
    bits = 0
    n = filt.shape[0]
    while n > 1:
        n >>= 1
        bits += 1
    return 64 - bits


@helper
def filter_add(filt: Any, fp: Any) -> None:
    mixed = mix(fp)
    filt[bloom_word(mixed, word_shift(filt))] |= bloom_mask(mixed)


@inline
def may_contain(filt: Any, fp: Any, fshift: Any) -> Any:
    """False only if no content with fingerprint ``fp`` was added since the last rebuild."""
    mixed = mix(fp)
    bm = bloom_mask(mixed)
    return (filt[bloom_word(mixed, fshift)] & bm) == bm
