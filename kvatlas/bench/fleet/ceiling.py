"""The ceiling: the hit ratio of an infinite cache with perfect routing (spec §4).

Every request may reuse what any earlier request computed, wherever it ran:

* its longest prefix of full ``block_size`` blocks that an earlier prompt began with (at most
  all but its last token: an engine always computes one);
* with fragment reuse (a connector stack is compared), after that prefix, chunks of
  ``chunk_size`` tokens that an earlier prompt held at a chunk boundary, found anywhere in the
  query and taken leftmost first without overlap, each at ``1 − recompute_share`` of its tokens.

Token sequences are compared by 64-bit polynomial hashes computed with numpy's wrapping uint64
arithmetic (a collision could only raise the ceiling by a block); a bitmap filters the query's
windows before the exact set membership, so a request costs O(prompt) vectorised work.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvatlas.workloads import TraceRequest

_BASE = np.uint64(0x9E3779B97F4A7C15 | 1)  # odd: invertible modulo 2^64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))
_BITMAP_BITS = 24


class _Powers:
    """B^i and B^-i modulo 2^64 for i < n, grown on demand."""

    def __init__(self) -> None:
        self.up = np.ones(1, dtype=np.uint64)
        self.down = np.ones(1, dtype=np.uint64)

    def need(self, n: int) -> None:
        have = self.up.shape[0]
        if n <= have:
            return
        size = max(n, 2 * have)
        up = np.empty(size, dtype=np.uint64)
        down = np.empty(size, dtype=np.uint64)
        up[:have], down[:have] = self.up, self.down
        with np.errstate(over="ignore"):
            for i in range(have, size):  # once per run, up to the longest prompt
                up[i] = up[i - 1] * _BASE
                down[i] = down[i - 1] * _BASE_INV
        self.up, self.down = up, down


class _Hasher:
    """Content hashes of one prompt's windows: ``window(i, L)`` is the polynomial of
    ``prompt[i : i + L]``, the same wherever those tokens sit."""

    def __init__(self, prompt: np.ndarray, powers: _Powers) -> None:
        n = prompt.shape[0]
        powers.need(n + 1)
        self._up = powers.up
        with np.errstate(over="ignore"):
            weighted = prompt.astype(np.uint64) * powers.down[:n]
            self._sums = np.concatenate(
                [np.zeros(1, np.uint64), np.cumsum(weighted, dtype=np.uint64)]
            )

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Σ p[s + j] · B^(L−1−j) = B^(s+L−1) · (C[s+L] − C[s])."""
        with np.errstate(over="ignore"):
            out: np.ndarray = self._up[starts + length - 1] * (
                self._sums[starts + length] - self._sums[starts]
            )
        return out

    def prefixes(self, ends: np.ndarray) -> np.ndarray:
        """The polynomial of ``prompt[:e]`` for each ``e``."""
        with np.errstate(over="ignore"):
            out: np.ndarray = self._up[ends - 1] * self._sums[ends]
        return out


def ceiling_hit_ratio(requests: Iterable[TraceRequest], block_size: int, chunk_size: int,
                      fragments: bool, recompute_share: float) -> float:  # fmt: skip
    powers = _Powers()
    prefixes: set[int] = set()
    chunks: set[int] = set()
    bitmap = np.zeros(1 << _BITMAP_BITS, dtype=bool)
    shift = np.uint64(64 - _BITMAP_BITS)
    prompt_tokens = reused = 0.0
    for req in requests:
        prompt = req.prompt
        n = prompt.shape[0]
        prompt_tokens += n
        if n == 0:
            continue
        h = _Hasher(prompt, powers)
        prefix_keys = h.prefixes(np.arange(block_size, n + 1, block_size)).tolist()
        hit = 0
        for k in prefix_keys[: (n - 1) // block_size]:
            if k not in prefixes:
                break
            hit += 1
        prefixes.update(prefix_keys)
        prefix = hit * block_size
        reused += prefix
        if fragments and n >= chunk_size:
            starts = np.arange(0, n - chunk_size + 1, dtype=np.int64)
            win = h.windows(starts, chunk_size)
            if chunks:
                maybe = np.nonzero(bitmap[win >> shift] & (starts >= prefix))[0]
                end = prefix
                taken = 0
                for i in maybe.tolist():
                    if i >= end and int(win[i]) in chunks:
                        taken += chunk_size
                        end = i + chunk_size
                reused += taken * (1.0 - recompute_share)
            aligned = win[::chunk_size]
            chunks.update(aligned.tolist())
            bitmap[aligned >> shift] = True
    return reused / prompt_tokens if prompt_tokens else 0.0
