"""``POST /route/score``'s reply: every candidate instance, best first (docs/route-scoring.md).
A row is checked on decoding — counts ≥ 0, ``by_tier`` exactly the four tier classes — so a
router never ranks on a half-read score."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]

TIER_NAMES: Final = ("gpu", "l1", "l2", "peer")
"""The ``by_tier`` keys of a reply (the coordinator's tier classes, in class order)."""
_TIERS: Final = frozenset(TIER_NAMES)


class RouteScoreRow(msgspec.Struct, kw_only=True, frozen=True):
    """One instance's row: the prefix it loads without recompute, the fragment tokens it can
    fetch after that prefix, tokens per tier class, and the weighted score."""

    instance_id: str
    prefix_tokens: Count
    fragment_tokens: Count
    score: float
    by_tier: dict[str, Count]

    def __post_init__(self) -> None:
        if self.by_tier.keys() != _TIERS:
            raise ValueError(f"by_tier must have exactly {TIER_NAMES}")


class RouteScoresReply(msgspec.Struct, kw_only=True, frozen=True):
    """The reply: rows best first, and how many tokens the query had."""

    instances: list[RouteScoreRow]
    query_tokens: Count

    @property
    def best(self) -> str | None:
        return self.instances[0].instance_id if self.instances else None
