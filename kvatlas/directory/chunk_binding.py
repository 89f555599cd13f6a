"""Storing into a known chunk and binding its content: the entry-by-entry half of the store
rules (:mod:`~kvatlas.directory.chunk_stores`), functions given the table, not methods, so
the entry-by-entry path reaches the table's state as directly as the table itself would. A
chunk held under keys of several salts has a binding per salt
(:mod:`~kvatlas.directory.tenant_bindings`).
"""

from __future__ import annotations

import logging

from kvatlas.directory.blend import AddOp, RemoveChunkOp
from kvatlas.directory.chunk_parts import ChunkPart
from kvatlas.directory.chunk_state import ChunkState
from kvatlas.directory.records import (
    PlacementRow,
    Record,
    find_key,
    group_placements,
    placements_at,
    placements_of,
    rebound,
    record_indexed,
    record_offset,
    record_stored_tokens,
    row_ident,
    row_size,
    shape_ids,
    with_key,
    with_placements_at,
)
from kvatlas.directory.tenant_bindings import Claim, bound_after, claim_ops, salt_namespaces
from kvatlas.directory.token_store import StoredTokens, stored_equal, token_count
from kvatlas.events import UNKNOWN_OFFSET
from kvatlas.keys import BlendNamespace

log = logging.getLogger(__name__)


def store_existing(
    table: ChunkState,
    h: bytes,
    part: ChunkPart,
    rec: Record,
    sid: int,
    p: PlacementRow,
    new_tokens: StoredTokens | None,
    new_offset: int,
    debug: bool,
) -> tuple[int, int, int]:
    """Store into a known chunk (``new_tokens``: the entry's tokens, stored); returns the
    (keys, placements, bytes) deltas."""
    k = find_key(rec, sid)
    old_rec = rec
    size = row_size(p)
    if k < 0:
        rec = with_key(rec, sid, p)
        dk, dp, db = 1, 1, size
    else:
        ident = row_ident(p)
        kept = []
        dk, dp, db = 0, 1, size
        for q in placements_of(placements_at(rec, k)):
            if row_ident(q) == ident:
                dp -= 1
                db -= row_size(q)
            else:
                kept.append(q)
        kept.append(p)
        rec = with_placements_at(rec, k, group_placements(kept))
    shapes = table.shapes.shapes
    if h in table.tenants.rows or (
        k < 0 and shapes[sid].cache_salt != shapes[shape_ids(old_rec)[0]].cache_salt
    ):  # a chunk of several salts: each salt's binding its own (directory/tenant_bindings.py;
        # a chunk without an entry there is one salt's)
        _store_tenant(table, h, part, old_rec, rec, sid, new_tokens, new_offset)
        return dk, dp, db
    tokens = record_stored_tokens(rec)
    offset, indexed = record_offset(rec), record_indexed(rec)
    new_claim = k < 0 and indexed and table.shapes[sid].namespace not in table.namespaces(old_rec)
    reindexed = False
    if new_tokens is not None and _conflicts(table, table.namespaces(rec), sid, tokens, new_tokens):
        new_tokens = None  # the chunk's binding stays (its keys' claims are on it, as ever)
    if new_tokens is not None:
        tokens, offset, indexed, reindexed = _bind(
            table, h, tokens, offset, indexed, rec, new_tokens, new_offset
        )
    elif tokens is None and debug:
        log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
    if new_claim and not reindexed and indexed and table.indexing:
        assert tokens is not None
        table.ops.append(AddOp(tokens, h, offset, table.shapes[sid].namespace))
    part[h] = rebound(rec, tokens, offset, indexed)
    return dk, dp, db


def _store_tenant(
    table: ChunkState,
    h: bytes,
    part: ChunkPart,
    old_rec: Record,
    rec: Record,
    sid: int,
    tokens: StoredTokens | None,
    offset: int,
) -> None:
    """Store into a chunk held under keys of several salts (``old_rec`` its record before
    the store, ``rec`` after): the store's salt's binding changes by the rules of one salt's
    chunk, and the index claims follow. A chunk's first key of a second salt first moves the
    record's binding to the salt of its keys."""
    shapes, chunk_size, tenants = table.shapes, table.chunk_size, table.tenants
    bindings = tenants.rows.get(h)
    before: set[Claim] = set()
    if bindings is None:
        salts = salt_namespaces(shapes, old_rec)
        held = record_stored_tokens(old_rec)
        bindings = {}  # (the record's binding is its one salt's)
        if held is not None and len(salts) == 1:
            bindings[next(iter(salts))] = (held, record_offset(old_rec))
        if held is not None and record_indexed(old_rec):  # (under the chunk hash itself)
            offset_held = record_offset(old_rec)
            before = {(held, h, offset_held, ns) for ns in table.namespaces(old_rec)}
    elif table.indexing:
        before = tenants.claims(h, shapes, old_rec, bindings, chunk_size)
    shape = shapes[sid]
    old = bindings.get(shape.cache_salt)
    if tokens is not None:
        spaces = salt_namespaces(shapes, rec)[shape.cache_salt]
        keep = old is not None and _conflicts(table, spaces, sid, old[0], tokens)
        bindings = {**bindings, shape.cache_salt: bound_after(old, tokens, offset, keep)}
    tenants.rows[h] = bindings
    if table.indexing:
        table.queue(claim_ops(before, tenants.claims(h, shapes, rec, bindings, chunk_size)))
    part[h] = rebound(rec, None, UNKNOWN_OFFSET, False)


def _conflicts(
    table: ChunkState,
    namespaces: set[BlendNamespace],
    sid: int,
    old: StoredTokens | None,
    new: StoredTokens,
) -> bool:
    """Whether a store under shape ``sid`` of ids other than the bound ones (``old``) must
    leave the binding as it is: another namespace than the store's (another model or world
    size) among ``namespaces``, the namespaces holding the binding, holds keys of the chunk.
    A chunk hash is one text's; a store of other ids under it comes from an emitter that
    lies or is broken, and must not change what the other namespaces match, reuse or read
    back. (Another salt's keys never share a binding: directory/tenant_bindings.py.)
    Counted (``content_conflicts``), logged at the first and every power of two."""
    if old is None or stored_equal(old, new):
        return False
    if not namespaces - {table.shapes[sid].namespace}:
        return False  # its namespace's alone: the last writer rebinds
    counts = table.counts
    counts.content_conflicts += 1
    n = counts.content_conflicts
    if n & (n - 1) == 0:
        log.warning(
            "a store under %s gave other token ids for a chunk other namespaces hold (#%d): "
            "the chunk's content is kept (an emitter that lies about chunk hashes, or is "
            "broken)", table.shapes[sid].namespace, n,
        )  # fmt: skip
    return True


def _bind(
    table: ChunkState,
    h: bytes,
    old: StoredTokens | None,
    old_offset: int,
    indexed: bool,
    rec: Record,
    tokens: StoredTokens,
    offset: int,
) -> tuple[StoredTokens | None, int, bool, bool]:
    """Bind ``tokens`` to the chunk (whose keys are ``rec``'s) and queue the index writes
    that follow. Returns the chunk's new ``(tokens, token_offset, indexed)`` and whether
    it (re)added every namespace."""
    if old is not None and stored_equal(old, tokens):
        if keeps_binding(offset, old_offset, indexed, table.indexing):
            return old, old_offset, indexed, False
        if offset == UNKNOWN_OFFSET:
            # bound before blend was on: this fresh report of the content indexes it
            offset = old_offset
        bound = old
    else:
        if indexed and table.indexing and old is not None:
            # Retire the old content before the new one appears: no window in which a match
            # returns new content at the old position (both go in one index batch).
            table.ops.append(RemoveChunkOp(old, h))
        indexed = False
        bound = tokens
        if token_count(tokens) != table.chunk_size:
            n = token_count(tokens)
            log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), n)
    # offset -1 is never indexed: a match without its stored position would be re-RoPEd
    # from the wrong place, i.e. wrong KV, which is worse than a miss.
    if not table.indexing or offset == UNKNOWN_OFFSET or token_count(bound) != table.chunk_size:
        return bound, offset, indexed, False
    table.ops.extend([AddOp(bound, h, offset, ns) for ns in table.namespaces(rec)])
    return bound, offset, True, True


def keeps_binding(offset: int, old_offset: int, indexed: bool, indexing: bool) -> bool:
    """Whether a report of a chunk's own content (equal ids) at ``offset`` leaves its binding
    as it is (the chunk bound at ``old_offset``, ``indexed`` or not): no offset or the same,
    and nothing to index (blend off, or indexed already)."""
    return offset in (UNKNOWN_OFFSET, old_offset) and (indexed or not indexing)
