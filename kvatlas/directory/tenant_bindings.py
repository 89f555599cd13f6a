"""Tenant bindings: a chunk held under keys of several cache salts has one binding per salt.

A chunk hash names one text for every tenant (the salt is in the key, not in the hash), so
tenants that store the same text, or claim to, hold keys of one chunk. What a tenant sees of
it must not depend on another tenant's data: the content its keys' lookups and listings
return, what its namespaces' blend matches find. With one binding per chunk, a tenant storing
a key of its own salt under another tenant's chunk hash (with no ids, or junk ones) read the
other's ids back — an existence oracle across tenants — and a tenant's junk bound first kept
another's real ids out.

So while a chunk's keys span several salts its record carries no binding (content ``None``,
unindexed: a path that reads records sees an unbound chunk) and each salt's binding — the
content and offset that salt's stores bound, by the rules a chunk of one salt follows — is
kept here. The blend index holds each salt's claims on its own binding. When the chunk's keys
come back to one salt, that salt's binding goes back into the record and the entry goes.
Chunks of one salt, nearly all of them, have no entry and pay nothing.

The blend index keeps one occupant per (content, chunk hash), with one offset: two salts'
bindings of equal ids at different offsets would answer each other's matches with the wrong
``old_st`` (wrong KV after re-RoPE), and leaving either out would tell one tenant what the
other holds. So each salt's binding of such a chunk is indexed under an occupant hash of its
own (:meth:`TenantBindings.occupant`: a keyed hash of the salt and the chunk hash, under a
secret of this process no tenant knows, so none can aim one at another's), which matches map
back to the chunk hash (:meth:`TenantBindings.matched`). Which claims the index holds is a
function of a chunk's bindings and keys (:meth:`TenantBindings.claims`); a change queues the
difference (:func:`claim_ops`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final, TypeVar

import blake3

from kvatlas.directory.blend import AddOp, BlendOp, MatchColumns, RemoveClaimOp
from kvatlas.directory.records import Record, shape_ids
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.token_store import StoredTokens, stored_equal, token_count
from kvatlas.events import UNKNOWN_OFFSET
from kvatlas.keys import BlendMatch, BlendNamespace

Binding = tuple[StoredTokens, int]
"""A salt's content of a chunk, as stored, and its token offset."""
Bindings = Mapping[str, Binding]
"""A chunk's bindings by salt (a salt that bound nothing: absent); replaced on a change,
never changed in place (a capture copies the entries, not them)."""
Claim = tuple[StoredTokens, bytes, int, BlendNamespace]
"""One namespace's claim in the blend index: content, occupant hash, offset, namespace."""

_T = TypeVar("_T")
_SECRET: Final = os.urandom(32)
"""The key of occupant hashes: this process's, never saved or sent (the index is rebuilt on
restore); one for every directory of the process, so two built alike hold alike."""
RETIRED_S: Final = 60.0
"""How long an occupant that left is still mapped back: a match that read the index before
it left (a blend lookup maps its matches after the index read, without the directory lock)
answers the chunk hash, never the occupant."""


def occupant_hash(h: bytes, salt: str) -> bytes:
    """A keyed hash of (salt, chunk hash ``h``), as long as ``h`` (the index's hash width),
    under this process's secret: one no tenant can aim at another chunk's hash or another
    salt's occupant (the directory's per-salt occupants; the node's, ``node/presence.py``)."""
    name = salt.encode()
    return blake3.blake3(len(name).to_bytes(4, "big") + name + h, key=_SECRET).digest(len(h))


class TenantBindings:
    """Chunk hash → :data:`Bindings` for every chunk held under keys of several salts (an
    empty one while none of its salts bound content); changed by the store and removal rules
    under the directory's lock."""

    __slots__ = ("_clock", "_leaving", "real", "retired", "rows")

    def __init__(
        self,
        rows: Mapping[bytes, Bindings] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rows: dict[bytes, Bindings] = {} if rows is None else dict(rows)
        self.real: dict[bytes, bytes] = {}
        """Occupant hash → chunk hash, of each salt's binding the index may hold."""
        self.retired: dict[bytes, tuple[bytes, float]] = {}
        """Occupants that left, for :data:`RETIRED_S`: → (chunk hash, when), oldest first."""
        self._leaving: list[tuple[bytes, bytes, str]] = []
        self._clock = clock

    def occupant(self, h: bytes, salt: str) -> bytes:
        """The hash the blend index holds ``salt``'s binding of chunk ``h`` under (as long
        as ``h``: the index's hash width)."""
        occupant = occupant_hash(h, salt)
        self.real[occupant] = h
        return occupant

    def _chunk(self, occupant: bytes) -> bytes:
        """The chunk hash of a hash a match returned (itself: a chunk of one salt's)."""
        h = self.real.get(occupant)
        if h is None:
            left = self.retired.get(occupant)
            h = occupant if left is None else left[0]
        return h

    def claims(
        self, h: bytes, shapes: ShapeTable, rec: Record, bindings: Bindings, chunk_size: int
    ) -> set[Claim]:
        """The index claims of chunk ``h`` of several salts (keys ``rec``'s): :func:`claims`,
        each salt's under its own occupant."""
        return claims(shapes, rec, bindings, lambda salt: self.occupant(h, salt), chunk_size)

    def matched(self, matches: list[BlendMatch]) -> list[BlendMatch]:
        """Blend matches, each occupant hash mapped back to its chunk hash."""
        if not self.real and not self.retired:
            return matches
        chunk = self._chunk
        return [BlendMatch(chunk(m.chunk_hash), m.old_st, m.cur_st) for m in matches]

    def matched_columns(self, columns: MatchColumns) -> MatchColumns:
        """:meth:`matched` of matches as columns."""
        if (not self.real and not self.retired) or not len(columns.old_st):
            return columns
        hashes = columns.chunk_hashes()
        if self.real.keys().isdisjoint(hashes) and self.retired.keys().isdisjoint(hashes):
            return columns
        return MatchColumns.of(list(map(self._chunk, hashes)), columns.old_st, columns.cur_st)

    def leave(self, h: bytes, salts: Sequence[str]) -> None:
        """``salts`` no longer hold bindings of chunk ``h`` under occupants of their own: their
        occupants retire once the index writes queued meanwhile are applied (:meth:`applied`)."""
        self._leaving += [(occupant_hash(h, salt), h, salt) for salt in salts]

    def applied(self) -> None:
        """The queued index writes were applied (or there were none): the occupants that left
        retire (unless their salt bound the chunk again since), mapped back for
        :data:`RETIRED_S` more; older retired ones are forgotten."""
        now, real, retired = self._clock(), self.real, self.retired
        for occupant, h, salt in self._leaving:
            if salt not in self.rows.get(h, ()) and real.pop(occupant, None) is not None:
                retired.pop(occupant, None)  # (to the end: oldest first)
                retired[occupant] = (h, now)
        self._leaving = []
        while retired:
            oldest = next(iter(retired))
            if now - retired[oldest][1] < RETIRED_S:
                break
            del retired[oldest]

    def copy(self) -> dict[bytes, Bindings]:
        """The entries as they are now (a capture's, under the directory's lock: one C-level
        copy, the :data:`Bindings` are never changed in place)."""
        return dict(self.rows)

    def bound(self) -> int:
        """How many of these chunks some salt bound content to."""
        return sum(1 for b in self.rows.values() if b)

    def contents(
        self, hashes: Sequence[bytes], salts: Sequence[str], contents: Sequence[_T | None]
    ) -> list[_T | StoredTokens | None]:
        """``contents`` (what the records of ``hashes`` hold, aligned with them) with each
        chunk of several salts' content replaced by the one ``salts[i]`` bound (``None``:
        that salt bound none)."""
        out: list[_T | StoredTokens | None] = list(contents)
        rows = self.rows
        if rows.keys().isdisjoint(hashes):
            return out
        for i, h in enumerate(hashes):
            bindings = rows.get(h)
            if bindings is not None:
                own = bindings.get(salts[i])
                out[i] = None if own is None else own[0]
        return out


def salt_namespaces(shapes: ShapeTable, rec: Record) -> dict[str, set[BlendNamespace]]:
    """The namespaces of a record's keys, by cache salt."""
    out: dict[str, set[BlendNamespace]] = {}
    for sid in shape_ids(rec):
        shape = shapes[sid]
        out.setdefault(shape.cache_salt, set()).add(shape.namespace)
    return out


def claims(
    shapes: ShapeTable,
    rec: Record,
    bindings: Bindings,
    occupant: Callable[[str], bytes],
    chunk_size: int,
) -> set[Claim]:
    """The index claims of a chunk (keys ``rec``'s, bindings ``bindings``): each salt's
    namespaces on its binding, under ``occupant(salt)``, when it is indexable (a known offset,
    ``chunk_size`` ids)."""
    spaces = salt_namespaces(shapes, rec)
    out: set[Claim] = set()
    for salt, (tokens, offset) in bindings.items():
        if salt not in spaces or offset == UNKNOWN_OFFSET or token_count(tokens) != chunk_size:
            continue
        at = occupant(salt)
        out.update((tokens, at, offset, ns) for ns in spaces[salt])
    return out


def claim_ops(before: set[Claim], after: set[Claim]) -> list[BlendOp]:
    """The index writes that take a chunk's claims from ``before`` to ``after``: the dropped
    claims first (an occupant whose offset changes goes with its last claim and comes back
    with the new one)."""
    ops: list[BlendOp] = [RemoveClaimOp(t, h, ns) for t, h, _, ns in before - after]
    return ops + [AddOp(t, h, at, ns) for t, h, at, ns in after - before]


def bound_after(old: Binding | None, tokens: StoredTokens, offset: int, keep: bool) -> Binding:
    """A salt's binding after one of its stores with ids (one without leaves it): equal ids
    keep the content (a known offset replaces the old one), other ids rebind it unless
    ``keep`` (another namespace of the salt holds the chunk)."""
    if old is not None and stored_equal(old[0], tokens):
        return old if offset in (UNKNOWN_OFFSET, old[1]) else (old[0], offset)
    return old if old is not None and keep else (tokens, offset)
