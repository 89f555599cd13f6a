"""Blend matches as columns: what the index's scan copies out and a reply writes, no object
per match (``BlendIndex.match_columns``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import _cpython, kernels
from kvatlas.directory.blend.op_checks import HASH_WIDTH
from kvatlas.keys import BlendMatch

_FULL_HASH = np.dtype(f"V{HASH_WIDTH}")  # a full-width hash as one item (tolist: its bytes)


class MatchColumns(NamedTuple):
    """Matches as columns, in :meth:`BlendIndex.match` order: the k-th match is
    ``BlendMatch(chunk_hashes()[k], old_st[k], cur_st[k])``. The hashes are kept as their bytes
    end to end (``hash_bytes``) and each one's length (``hash_lengths``, at most
    ``HASH_WIDTH``): what the scan copies out and the reply writes, no object per match."""

    hash_bytes: npt.NDArray[np.uint8]
    hash_lengths: npt.NDArray[np.uint8]
    old_st: npt.NDArray[np.int64]
    cur_st: npt.NDArray[np.int64]

    @classmethod
    def empty(cls) -> MatchColumns:
        no_hits = np.empty(0, np.int64)  # (a lookup without hits: no join, no length pass)
        return cls(np.empty(0, np.uint8), np.empty(0, np.uint8), no_hits, no_hits)

    @classmethod
    def of(
        cls, hashes: list[bytes], old_st: npt.NDArray[np.int64], cur_st: npt.NDArray[np.int64]
    ) -> MatchColumns:
        """The columns of ``hashes`` (each at most ``HASH_WIDTH`` bytes) and the offsets."""
        lengths = np.fromiter(map(len, hashes), np.int64, len(hashes))
        if len(hashes) and int(lengths.max()) > HASH_WIDTH:
            raise ValueError(f"a chunk_hash longer than {HASH_WIDTH} bytes")
        raw = np.frombuffer(b"".join(hashes), np.uint8)
        return cls(raw, lengths.astype(np.uint8), old_st, cur_st)

    @property
    def n_matches(self) -> int:
        return int(self.old_st.shape[0])

    @property
    def full_width(self) -> bool:
        """Whether every hash has ``HASH_WIDTH`` bytes (none has more: then none has fewer);
        the usual case, which needs no length each."""
        return int(self.hash_bytes.shape[0]) == HASH_WIDTH * self.n_matches

    def chunk_hashes(self) -> list[bytes]:
        """Each match's chunk_hash as ``bytes``."""
        if self.full_width:  # (a void item is its bytes: one C-level pass, no slicing)
            hashes: list[bytes] = np.ascontiguousarray(self.hash_bytes).view(_FULL_HASH).tolist()
            return hashes
        raw = self.hash_bytes.tobytes()
        ends = np.cumsum(self.hash_lengths, dtype=np.int64).tolist()
        return [raw[a:b] for a, b in zip([0, *ends], ends, strict=False)]

    def matches(self) -> list[BlendMatch]:
        return _cpython.make_matches(
            self.chunk_hashes(), self.old_st.tolist(), self.cur_st.tolist()
        )


def first_of_each_hash(parts: list[MatchColumns]) -> MatchColumns:
    """The segments' matches in order, each chunk_hash at its first (a long query's segments
    are scanned apart: a chunk may be found in two), kept by one compiled pass over their
    hashes' bytes (``kernels.joined_firsts``)."""
    kept, hash_bytes, hash_lengths = kernels.joined_firsts(
        np.concatenate([p.hash_bytes for p in parts]),
        np.concatenate([p.hash_lengths for p in parts]),
    )
    old, cur = (np.concatenate([getattr(p, f) for p in parts])[kept] for f in ("old_st", "cur_st"))
    return MatchColumns(hash_bytes, hash_lengths, old, cur)
