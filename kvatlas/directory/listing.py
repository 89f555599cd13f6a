"""Key listing: pages of keys in chunk-hash order, resumable from an opaque cursor.

Keys present throughout a listing are returned exactly once, however the directory changes
between pages. A page sorts only the partitions it visits (no full scan per page) and examines
at most ``max_scan`` keys, so a selective filter may return a short page with a cursor (as
Redis SCAN does). :func:`page_keys` adds offset pagination on top. See docs/directory.md.
"""

from __future__ import annotations

import bisect
import json
import threading
from dataclasses import dataclass
from typing import Final, Protocol

from kvatlas.directory.chunk_counts import PARTS
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.records import (
    KeyPage,
    KeyPlacements,
    PlacementRow,
    Placements,
    pack_placements,
    placements_of,
    public_placements,
    record_keys,
    record_tokens,
    row_backend,
    row_instance,
    row_tier,
)
from kvatlas.directory.shapes import KeyShape
from kvatlas.directory.token_store import widened
from kvatlas.errors import InvalidInput
from kvatlas.keys.object_key import ShapeParts


@dataclass(frozen=True, slots=True)
class KeyFilter:
    """Which keys a listing or a count takes: those with a placement in ``tier``, on
    ``instance_id`` and in ``backend`` (``None``: any), one placement meeting all three; a
    listed key carries those of its placements only (as LMCache's listing does)."""

    tier: str | None = None
    instance_id: str | None = None
    backend: str | None = None

    @property
    def takes_all(self) -> bool:
        return self.tier is None and self.instance_id is None and self.backend is None

    def admits_row(self, row: PlacementRow) -> bool:
        """Whether the filter takes a key with this stored placement row (read as it is
        stored: no :class:`~kvatlas.directory.records.Placement` built)."""
        return (
            (self.tier is None or row_tier(row) == self.tier)
            and (self.backend is None or row_backend(row) == self.backend)
            and (self.instance_id is None or row_instance(row) == self.instance_id)
        )


ALL_KEYS: Final = KeyFilter()


def admitted(where: KeyFilter, pls: Placements) -> Placements | None:
    """The placements of ``pls`` that ``where`` admits (``None``: none)."""
    return pack_placements(list(filter(where.admits_row, placements_of(pls))))


class Listable(Protocol):
    """What :func:`page_keys` pages through (a ``KeyDirectory``)."""

    def list_keys(self, where: KeyFilter = ALL_KEYS, *, cursor: str | None = None,
                  limit: int = 100, max_scan: int | None = None) -> KeyPage: ...  # fmt: skip

    def count_keys(self, where: KeyFilter = ALL_KEYS) -> int: ...


def list_keys(
    chunks: ChunkTable,
    lock: threading.Lock,
    where: KeyFilter = ALL_KEYS,
    *,
    cursor: str | None = None,
    limit: int = 100,
    max_scan: int | None = None,
) -> KeyPage:
    """One page of the keys of ``chunks`` that ``where`` admits: each partition's records
    read under ``lock`` (a partition a hold), the page built from them after it. Raises
    :class:`InvalidInput` on a bad cursor or limit."""
    if limit < 1:
        raise InvalidInput("limit must be >= 1")
    start, skip, after = _parse_cursor(cursor)
    budget = max_scan if max_scan is not None else max(4096, 64 * limit)
    items: list[KeyPlacements] = []
    scanned = 0
    takes_all = where.takes_all
    for part_no in range(start[0] if start else 0, PARTS):
        # Under the lock: the partition's chunks in order and the records of as many as the
        # page can still examine (a chunk has a key at least, and every key counts when the
        # filter takes all), plus one; records are immutable, so the page is built after it.
        room = limit - len(items) if takes_all else budget - scanned
        with lock:
            shapes = chunks.shapes.shapes
            part = chunks.parts[part_no]
            order = sorted(h for h in part if start is None or h >= start)
            records = part.records_at(order[: room + 1])
            tenants = chunks.tenants.rows
            salted = {h: tenants[h] for h in order[: room + 1] if h in tenants} if tenants else {}
        for h, rec in zip(order, records, strict=False):
            pairs = sorted(
                ((shapes[sid], pls) for sid, pls in record_keys(rec)), key=lambda kv: kv[0].parts
            )
            first = 0
            if h == start:  # the keys of the cursor's chunk it had not reached, by key
                first = skip if after is None else bisect.bisect_left(pairs, after, key=_parts)
            for n in range(first, len(pairs)):
                if len(items) == limit or scanned >= budget:
                    return KeyPage(items, _cursor_at(h, n, pairs[n][0].parts))
                scanned += 1
                shape, pls = pairs[n]
                shown = pls if takes_all else admitted(where, pls)
                if shown is not None:
                    content = record_tokens(rec)
                    if h in salted:  # a chunk of several salts: the key's salt's content
                        own = salted[h].get(shape.cache_salt)
                        content = None if own is None else widened(own[0])
                    items.append(KeyPlacements(shape.key(h), public_placements(shown), content))
        if len(records) < len(order):  # (a start chunk's skipped keys left the page short)
            return KeyPage(items, f"{order[len(records)].hex()}:0")
        start = None
    return KeyPage(items, None)


def count_keys(chunks: ChunkTable, lock: threading.Lock, where: KeyFilter = ALL_KEYS) -> int:
    """How many keys ``where`` admits (the ``total`` of a listing). Taking all keys it is a
    counter; else a pass that holds ``lock`` for one partition at a time, so ingestion is
    never stalled behind a whole scan."""
    if where.takes_all:
        with lock:
            return chunks.counts.keys
    total = 0
    for part_no in range(PARTS):
        with lock:
            for rec in chunks.parts[part_no].values():
                for _, pls in record_keys(rec):
                    total += any(where.admits_row(p) for p in placements_of(pls))
    return total


def page_keys(
    directory: Listable,
    where: KeyFilter = ALL_KEYS,
    *,
    offset: int = 0,
    limit: int = 100,
    cursor: str | None = None,
) -> KeyPage:
    """A page of ``limit`` keys that ``where`` admits from ``cursor``, or (without a cursor)
    after skipping ``offset`` keys: LMCache's offset pagination over the cursor listing.
    ``next_offset`` is set only for an offset listing that goes on. Raises
    :class:`InvalidInput` (a ``ValueError``) on a malformed cursor."""
    next_cursor = cursor
    skip = 0 if cursor else offset
    items: list[KeyPlacements] = []
    while True:
        want = min(10_000, skip) if skip else limit - len(items)
        got = directory.list_keys(where, cursor=next_cursor, limit=want)
        next_cursor = got.next_cursor
        if skip:
            taken = min(skip, len(got.items))
            skip -= taken
            items.extend(got.items[taken:])
        else:
            items.extend(got.items)
        if next_cursor is None or (not skip and len(items) >= limit):
            break
    next_offset = offset + len(items) if next_cursor is not None and not cursor else None
    total = directory.count_keys(where)
    return KeyPage(items[:limit], next_cursor, next_offset, total)


def _parts(pair: tuple[KeyShape, object]) -> ShapeParts:
    return pair[0].parts


def _cursor_at(h: bytes, n: int, parts: ShapeParts) -> str:
    """A cursor at the ``n``-th key (``parts``) of chunk ``h``: a page from it resumes at
    the first of that chunk's keys not before ``parts`` (keys going or coming before it
    between pages shift the positions: a position alone skipped or repeated keys)."""
    return f"{h.hex()}:{n}:{json.dumps(parts, separators=(',', ':')).encode().hex()}"


def _parse_cursor(cursor: str | None) -> tuple[bytes | None, int, ShapeParts | None]:
    """``(chunk hash, keys of that chunk to skip, the first key of it to return)`` of a
    cursor (``(None, 0, None)``: the start; a cursor without the key skips by position)."""
    if not cursor:
        return None, 0, None
    try:
        text, n, *rest = cursor.split(":", 2)
        h = bytes.fromhex(text)
        skip = int(n or 0)
        after = None
        if rest:
            model, rank, group, salt = json.loads(bytes.fromhex(rest[0]))
            after = (model, rank, group, salt)
            if not (isinstance(model, str) and isinstance(salt, str)) or not all(
                type(x) is int for x in (rank, group)
            ):
                raise ValueError(after)
    except (ValueError, TypeError):
        raise InvalidInput(f"invalid cursor {cursor!r:.80}") from None
    if len(h) != 32 or skip < 0:
        raise InvalidInput(f"invalid cursor {cursor!r:.80}")
    return h, skip, after
