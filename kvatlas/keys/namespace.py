"""BlendNamespace: the scope within which a stored chunk may be served to a requester;
BlendMatch, what a fragment lookup finds in it; and :func:`leftmost_greedy`, the one rule by
which overlapping matches become the coverage a request reuses (the node's blend lookup and
the coordinator's route scoring both resolve matches with it).

Another model's KV is not interchangeable, another tenant's salt is isolated by design and
another parallel layout shards heads differently, so a fragment match is only ever served
inside the namespace that stored it. ``object_group_id`` is deliberately not part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvatlas.checks import is_plain_int
from kvatlas.keys.object_key import ObjectKey, check_cache_salt, check_model_name


@dataclass(frozen=True, slots=True)
class BlendNamespace:
    model_name: str
    cache_salt: str = ""
    world_size: int = 1

    def __post_init__(self) -> None:
        check_model_name(self.model_name)
        check_cache_salt(self.cache_salt)
        ws = self.world_size
        if not is_plain_int(ws) or not 1 <= ws <= 255:
            raise ValueError(f"world_size must be an integer in [1, 255], got {ws!r}")

    @classmethod
    def from_object_key(cls, key: ObjectKey) -> BlendNamespace:
        return cls(key.model_name, key.cache_salt, key.world_size)


@dataclass(frozen=True, slots=True)
class BlendMatch:
    """A cached chunk found in a query: re-RoPE its KV from ``old_st`` to ``cur_st``."""

    chunk_hash: bytes
    old_st: int
    cur_st: int


def leftmost_greedy(starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Of intervals ``[starts[k], ends[k])`` already in leftmost order (by start, ties in the
    caller's preference), the indices of those that start at or after the end of the last one
    kept: pairwise disjoint and maximal. For equal-length intervals (whole chunks) it keeps the
    most, hence covers the most tokens: the earliest start is then also the earliest end, the
    classic optimal interval-scheduling greedy."""
    kept: list[int] = []
    frontier = -1
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if start >= frontier:
            kept.append(k)
            frontier = end
    return kept
