"""Directory records: what lookups return (placements, prefix summaries, pages) and the
compact per-chunk state behind them.

Per-chunk state is deliberately lean (the directory holds millions of chunks): a chunk's keys
are a flat immutable tuple ``(shape, placements, shape, placements, ...)`` where a *shape* is
the interned non-hash part of an ObjectKey, and ``placements`` is one :class:`Placement` or a
tuple of them. Immutable values let snapshots copy-on-write at chunk granularity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvatlas.keys import BlendNamespace, ObjectKey
from kvatlas.keys.tokens import TokenArray


@dataclass(frozen=True, slots=True)
class Placement:
    """One live copy of a key. For a shared backend ``instance_id`` is the last reporter."""

    instance_id: str
    incarnation: int
    tier: str
    backend: str
    size_bytes: int
    shared: bool
    last_access: float

    @property
    def ident(self) -> tuple[str, str, str | None]:
        """Shared pools hold one copy per (tier, backend) fleet-wide; others one per instance."""
        return (self.tier, self.backend, None if self.shared else self.instance_id)

    def sort_key(self) -> tuple[str, str, str]:
        return (self.instance_id, self.tier, self.backend)


Placements = Placement | tuple[Placement, ...]


def placements_of(value: Placements) -> tuple[Placement, ...]:
    return (value,) if isinstance(value, Placement) else value


def pack_placements(items: tuple[Placement, ...] | list[Placement]) -> Placements | None:
    if not items:
        return None
    return items[0] if len(items) == 1 else tuple(items)


@dataclass(frozen=True, slots=True)
class KeyShape:
    """The part of an ObjectKey besides its chunk hash; interned, shared by many keys."""

    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str
    namespace: BlendNamespace = field(compare=False)

    @property
    def parts(self) -> tuple[str, int, int, str]:
        return (self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)

    def key(self, chunk_hash: bytes) -> ObjectKey:
        return ObjectKey(chunk_hash, *self.parts)


class Chunk:
    """State of one chunk hash: its token binding and its keys (see module docstring).

    ``indexed`` says whether the content is in the blend index, claimed by exactly the
    namespaces of ``keys``.
    """

    __slots__ = ("indexed", "keys", "token_offset", "tokens")

    def __init__(
        self,
        tokens: TokenArray | None = None,
        token_offset: int = -1,
        keys: tuple[Any, ...] = (),
    ) -> None:
        self.tokens = tokens
        self.token_offset = token_offset
        self.keys = keys
        self.indexed = False

    def namespaces(self) -> set[BlendNamespace]:
        keys = self.keys
        if len(keys) == 2:
            return {keys[0].namespace}
        return {s.namespace for s in keys[0::2]}


@dataclass(frozen=True, slots=True)
class KeyPlacements:
    key: ObjectKey
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class PrefixHolder:
    """How many leading chunks of a query one holder has, all ranks included.

    ``instance_id`` is ``None`` for a shared pool (then ``backend`` names the pool).
    """

    instance_id: str | None
    tier: str
    backend: str
    shared: bool
    chunks: int


@dataclass(frozen=True, slots=True)
class TokenLookup:
    chunks: int
    results: list[KeyPlacements]
    prefix: list[PrefixHolder]


@dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of :meth:`KeyDirectory.list_keys`; ``next_cursor`` is ``None`` at the end."""

    items: list[KeyPlacements]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class CapacityDeclaration:
    """The newest capacity declaration of an instance (``config`` events)."""

    incarnation: int
    revision: int
    capacities: dict[tuple[str, str], int]  # (tier, backend) -> bytes
