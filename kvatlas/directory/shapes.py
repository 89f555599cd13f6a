"""Key shapes: the part of an ObjectKey besides its chunk hash, interned once per directory.

A shape id, once handed out, names the same shape for as long as its table lives: the table
only grows. That is what lets a snapshot capture read shape ids after releasing the directory
lock, and lets the snapshot loader build a table the directory adopts as is (see
docs/directory.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvatlas.events.columns import EntryColumns
from kvatlas.keys import BlendNamespace, ObjectKey
from kvatlas.keys.object_key import ShapeParts, shape_parts


@dataclass(frozen=True, slots=True)
class KeyShape:
    """The part of an ObjectKey besides its chunk hash; interned, shared by many keys."""

    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str
    namespace: BlendNamespace = field(compare=False)

    @property
    def parts(self) -> ShapeParts:
        return (self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)

    def key(self, chunk_hash: bytes) -> ObjectKey:
        return ObjectKey(chunk_hash, *self.parts)


class ShapeTable:
    """Shape id → :class:`KeyShape`, append-only. Not thread-safe on its own (the directory's
    lock covers interning; reading ids already handed out needs no lock)."""

    __slots__ = ("_ids", "_shapes", "groups")

    def __init__(self) -> None:
        self._ids: dict[ShapeParts, int] = {}
        self._shapes: list[KeyShape] = []
        self.groups: set[int] = set()
        """The object groups of the shapes (one, 0, unless a fleet separates them)."""

    @property
    def shapes(self) -> Sequence[KeyShape]:
        """Shape id → shape (read-only view, for hot loops that index it directly)."""
        return self._shapes

    def __len__(self) -> int:
        return len(self._shapes)

    def __getitem__(self, shape_id: int) -> KeyShape:
        return self._shapes[shape_id]

    def intern(self, key: ObjectKey) -> int:
        """The id of ``key``'s shape, interning it if new."""
        parts = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        sid = self._ids.get(parts)
        if sid is None:
            ns = BlendNamespace(key.model_name, key.cache_salt, key.world_size)
            sid = self._ids[parts] = len(self._shapes)
            self._shapes.append(KeyShape(*parts, ns))
            self.groups.add(key.object_group_id)
        return sid

    def intern_columns(self, cols: EntryColumns) -> list[int]:
        """:meth:`intern` of every entry's key shape, in order: one lookup per distinct shape."""
        get = self._ids.get
        ids = []
        for parts in cols.shapes:
            sid = get(parts)
            ids.append(self.intern(ObjectKey(bytes(32), *parts)) if sid is None else sid)
        return _per_entry(ids, cols)

    def ids_of_columns(self, cols: EntryColumns) -> list[int | None]:
        """:meth:`id_of` of every entry's key shape, in order (``None``: a shape never
        interned, so no key of it is held); interns nothing."""
        return _per_entry(list(map(self._ids.get, cols.shapes)), cols)

    def id_of(self, key: ObjectKey) -> int | None:
        """``key``'s shape id, ``None`` if no key of that shape was ever interned."""
        return self._ids.get(shape_parts(key))

    def ids_of(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        """:meth:`id_of` of each key (C-level maps: a lookup's keys; keys of one shape, the
        usual lookup, compared rather than each looked up)."""
        parts = list(map(shape_parts, keys))
        if parts and parts.count(parts[0]) == len(parts):
            return [self._ids.get(parts[0])] * len(parts)
        return list(map(self._ids.get, parts))

    def id_of_parts(self, parts: tuple[str, int, int, str]) -> int | None:
        """:meth:`id_of` for ``(model_name, kv_rank, object_group_id, cache_salt)``."""
        return self._ids.get(parts)

    def namespaces(self, shape_ids: Sequence[int]) -> set[BlendNamespace]:
        """The blend namespaces of these shapes."""
        shapes = self._shapes
        if len(shape_ids) == 1:
            return {shapes[shape_ids[0]].namespace}
        return {shapes[s].namespace for s in shape_ids}


_T = TypeVar("_T")


def _per_entry(ids: list[_T], cols: EntryColumns) -> list[_T]:
    """Each entry's id of its shape, from the ids of ``cols.shapes`` (one shape, the usual
    batch: no lookup per entry)."""
    if len(ids) == 1:
        return ids * len(cols)
    return list(map(ids.__getitem__, cols.shape_of.tolist()))
