"""Key listing: pages of keys in chunk-hash order, resumable from an opaque cursor.

Keys present throughout a listing are returned exactly once, however the directory changes
between pages. A page sorts only the partitions it visits (no full scan per page) and examines
at most ``max_scan`` keys, so a selective filter may return a short page with a cursor (as
Redis SCAN does). :func:`page_keys` adds offset pagination on top. See docs/directory.md.
"""

from __future__ import annotations

import threading
from typing import Protocol

from kvatlas.directory.chunk_counts import PARTS
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.records import (
    KeyPage,
    KeyPlacements,
    Placement,
    placements_of,
    public_placements,
    record_keys,
    record_tokens,
    row_backend,
    row_instance,
    row_tier,
)
from kvatlas.errors import InvalidInput


class Listable(Protocol):
    """What :func:`page_keys` pages through (a ``KeyDirectory``)."""

    def list_keys(self, *, tier: str | None = None, instance_id: str | None = None,
                  backend: str | None = None, cursor: str | None = None, limit: int = 100,
                  max_scan: int | None = None) -> KeyPage: ...  # fmt: skip

    def count_keys(self, *, tier: str | None = None, instance_id: str | None = None,
                   backend: str | None = None) -> int: ...  # fmt: skip


def list_keys(
    chunks: ChunkTable,
    lock: threading.Lock,
    *,
    tier: str | None = None,
    instance_id: str | None = None,
    backend: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
    max_scan: int | None = None,
) -> KeyPage:
    """One page of the keys of ``chunks`` (read under ``lock``) that have a placement
    matching every given filter. Raises :class:`InvalidInput` on a bad cursor or limit."""
    if limit < 1:
        raise InvalidInput("limit must be >= 1")
    start, skip = _parse_cursor(cursor)
    budget = max_scan if max_scan is not None else max(4096, 64 * limit)

    def wanted(p: Placement) -> bool:
        return (
            (tier is None or p.tier == tier)
            and (backend is None or p.backend == backend)
            and (instance_id is None or p.instance_id == instance_id)
        )

    items: list[KeyPlacements] = []
    scanned = 0
    with lock:
        shapes = chunks.shapes
        for part_no in range(start[0] if start else 0, PARTS):
            part = chunks.parts[part_no]
            order = sorted(h for h in part if start is None or h >= start)
            for h in order:
                pairs = sorted(
                    ((shapes[sid], pls) for sid, pls in record_keys(part[h])),
                    key=lambda kv: kv[0].parts,
                )
                first = skip if h == start else 0
                for n in range(first, len(pairs)):
                    if len(items) == limit or scanned >= budget:
                        return KeyPage(items, f"{h.hex()}:{n}")
                    scanned += 1
                    shape, pls = pairs[n]
                    found = public_placements(pls)
                    if any(wanted(p) for p in found):
                        items.append(KeyPlacements(shape.key(h), found, record_tokens(part[h])))
            start = None
    return KeyPage(items, None)


def count_keys(
    chunks: ChunkTable,
    lock: threading.Lock,
    *,
    tier: str | None = None,
    instance_id: str | None = None,
    backend: str | None = None,
) -> int:
    """How many keys have a placement matching every given filter (the ``total`` of a
    listing). Without filters it is a counter; with one, a pass that holds ``lock`` for one
    partition at a time, so ingestion is never stalled behind a whole scan."""
    if tier is None and instance_id is None and backend is None:
        with lock:
            return chunks.counts.keys
    total = 0
    for part_no in range(PARTS):
        with lock:
            for rec in chunks.parts[part_no].values():
                for _, pls in record_keys(rec):
                    total += any(
                        (tier is None or row_tier(p) == tier)
                        and (backend is None or row_backend(p) == backend)
                        and (instance_id is None or row_instance(p) == instance_id)
                        for p in placements_of(pls)
                    )
    return total


def page_keys(
    directory: Listable,
    *,
    tier: str | None = None,
    instance_id: str | None = None,
    backend: str | None = None,
    offset: int = 0,
    limit: int = 100,
    cursor: str | None = None,
) -> KeyPage:
    """A page of ``limit`` keys from ``cursor``, or (without a cursor) after skipping ``offset``
    keys: LMCache's offset pagination over the cursor listing. ``next_offset`` is set only for
    an offset listing that goes on. Raises :class:`InvalidInput` (a ``ValueError``) on a
    malformed cursor."""
    next_cursor = cursor
    skip = 0 if cursor else offset
    items: list[KeyPlacements] = []
    while True:
        want = min(10_000, skip) if skip else limit - len(items)
        got = directory.list_keys(
            tier=tier, instance_id=instance_id, backend=backend, cursor=next_cursor, limit=want
        )
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
    total = directory.count_keys(tier=tier, instance_id=instance_id, backend=backend)
    return KeyPage(items[:limit], next_cursor, next_offset, total)


def _parse_cursor(cursor: str | None) -> tuple[bytes | None, int]:
    """``(chunk hash, keys of that chunk to skip)`` of a cursor (``(None, 0)``: the start)."""
    if not cursor:
        return None, 0
    try:
        text, _, n = cursor.partition(":")
        h = bytes.fromhex(text)
        skip = int(n or 0)
    except ValueError:
        raise InvalidInput(f"invalid cursor {cursor!r:.80}") from None
    if len(h) != 32 or skip < 0:
        raise InvalidInput(f"invalid cursor {cursor!r:.80}")
    return h, skip
