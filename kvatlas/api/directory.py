"""Replies of the directory's routes: ``POST /directory/lookup`` (both forms),
``GET /directory/keys`` and ``POST /directory/blend-lookup``.

Fields only kvatlas sends (a placement's ``last_access``, the lookup's ``prefix``, the
listing's ``total``, ``enable_blend_lookup``) have defaults, so LMCache's replies decode too. A blend
match is checked on decoding (a 64-hex-digit hash, positions ≥ 0): a match that is not is
never trusted — it would name the wrong KV."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

Count = Annotated[int, msgspec.Meta(ge=0)]
HexHash = Annotated[str, msgspec.Meta(pattern="^[0-9a-fA-F]{64}$")]


class KeyRow(msgspec.Struct, kw_only=True, frozen=True):
    """An ObjectKey as JSON (``kvatlas.keys.ObjectKey.to_wire`` / ``from_wire`` check it)."""

    chunk_hash_hex: Annotated[
        str, msgspec.Meta(description="64 lower- or upper-case hex characters")
    ]
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The form ``ObjectKey.from_wire`` reads."""
        return msgspec.structs.asdict(self)


class PlacementRow(msgspec.Struct, kw_only=True, frozen=True):
    """One live copy of a key."""

    instance_id: str
    incarnation: int
    tier: str
    backend: str
    size_bytes: int
    shared: bool
    last_access: float = 0.0


class LookupResultRow(msgspec.Struct, kw_only=True, frozen=True):
    """One key of a lookup: its placements and its chunk's tokens (``[]``: unknown).
    ``access_count`` is LMCache's; kvatlas records when a copy was last accessed, not how
    often, and sends 0 (docs/coordinator.md, "Differences from LMCache")."""

    key: KeyRow
    placements: list[PlacementRow]
    token_ids: list[int] = []
    access_count: int = 0


class PrefixRow(msgspec.Struct, kw_only=True, frozen=True):
    """How many leading chunks of a query one holder has (``instance_id`` ``None``: a shared
    pool, named by ``backend``)."""

    instance_id: str | None
    tier: str
    backend: str
    shared: bool
    chunks: int


class LookupReply(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /directory/lookup``: ``chunks`` (the keys asked; a token query's full chunks),
    placements per key (request order; a token query's keys each followed by its chunk's keys
    in other object groups), prefix."""

    chunks: int
    results: list[LookupResultRow]
    prefix: list[PrefixRow] = []


class KeyEntryRow(msgspec.Struct, kw_only=True, frozen=True):
    """One key of a listing: its placements and how many tokens its chunk binds."""

    key: KeyRow
    placements: list[PlacementRow]
    num_tokens: int = 0
    access_count: int = 0


class KeyPageReply(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /directory/keys``: how many keys match, one page, and how to ask for the next
    (``None`` at the end)."""

    total: int | None = None
    keys: list[KeyEntryRow]
    next_cursor: str | None
    next_offset: int | None = None


class BlendHolderRow(msgspec.Struct, kw_only=True, frozen=True):
    """Who holds a matched chunk (``?with_placements=true``), per rank."""

    instance_id: str
    tier: str
    backend: str
    shared: bool
    kv_rank: int


class BlendMatchRow(msgspec.Struct, kw_only=True, frozen=True):
    """A cached chunk found in the query: stored at ``old_st``, found at ``cur_st``."""

    chunk_hash: HexHash
    old_st: Count
    cur_st: Count
    placements: list[BlendHolderRow] | UnsetType = UNSET


class BlendReply(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /directory/blend-lookup``. ``enable_blend_lookup`` is kvatlas's, the
    coordinator's flag (``false``: blend lookup is off, so ``[]`` says nothing about the
    fleet)."""

    matches: list[BlendMatchRow]
    enable_blend_lookup: bool | UnsetType = UNSET

    def check_positions(self, n_tokens: int) -> None:
        """Every match lies inside a query of ``n_tokens`` (``ValueError`` otherwise)."""
        if any(m.cur_st >= n_tokens for m in self.matches):
            raise ValueError("match positions out of range")
