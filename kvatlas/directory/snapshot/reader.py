"""Reading snapshots: all or nothing, column-wise.

:func:`load_snapshot` either installs the whole snapshot or raises :class:`SnapshotError` and
leaves the directory as it was: every column is checked against the others before anything is
built. Restore works column-wise: vectorised checks, records zipped from columns (a Python loop
only for chunks with several keys or placements), partitions built from the file's partition
order (the chunks sorted by it if the file's are not), counters and each chunk's L1 owners
computed from the columns instead of a pass over the records. Token ids are read and copied
into each chunk's content piece by piece (``token_section.py``) while the reader builds the
records and, blend on, the index (``blend_build.py``). See docs/directory.md.
"""

from __future__ import annotations

import gc
import io
import os
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.hash_words import HashWords
from kvatlas.directory.blend.kernels.planes import FORM_PLANES, FORM_U16, FORM_U32, MAX_HIGH_BITS
from kvatlas.directory.capture import DirectoryState, Restored
from kvatlas.directory.chunk_counts import L2_TIER, PARTS, ChunkCounts
from kvatlas.directory.chunk_parts import ChunkPart, parts_of_columns
from kvatlas.directory.gate import EmitterCursor, GapRecord
from kvatlas.directory.key_directory import KeyDirectory
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPair,
    Module,
    PlacementRow,
    group_placements,
    make_record,
    record_indexed,
    record_offset,
    record_stored_tokens,
    rows_from_columns,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.snapshot.blend_build import built_index, index_room, indexable_chunks
from kvatlas.directory.snapshot.format import (
    HASH_BYTES,
    MAGIC,
    PREFIX,
    READABLE,
    TIERS,
    Columns,
    Header,
    SnapshotError,
    SnapshotInfo,
    decode_column,
)
from kvatlas.directory.snapshot.integrity import checked_trailer, trailer_size
from kvatlas.directory.snapshot.token_section import read_exactly, read_token_section
from kvatlas.directory.tenant_bindings import Binding, Bindings
from kvatlas.directory.token_store import form_sizes, stored_one
from kvatlas.events import VOLATILE_TIERS
from kvatlas.keys import ObjectKey


def load_snapshot(directory: KeyDirectory, path: str | os.PathLike[str]) -> SnapshotInfo:
    """Replace ``directory``'s state with the snapshot at ``path``; rebuild the blend index
    from the restored bindings if blend lookup is on. Raises :class:`SnapshotError`.

    The cyclic collector is paused meanwhile: a restore builds no cycle, but lists of a
    reference per chunk (hashes, contents, the table's columns), which each young collection
    traversed while they were young (docs/performance.md, "Directory: design figures")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(directory, path)
    finally:
        if was_enabled:
            gc.enable()


def _load(directory: KeyDirectory, path: str | os.PathLike[str]) -> SnapshotInfo:
    started = time.perf_counter()
    # unbuffered: the token section is read from the file as it is then, never from a
    # buffer filled with the header (a file cut short meanwhile is refused whatever the
    # header's size)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        header, body, prefix, raw = _read_header(f, size)
        digests, trailer, piece = None, 0, None
        if header.version >= 6:  # checked before any column is decoded
            chunks = len(header.chunk_hashes) // HASH_BYTES
            piece = header.checksum_piece
            digests = checked_trailer(f, size, chunks, piece, prefix, raw)
            trailer = trailer_size(chunks, piece)
        del prefix, raw
        columns = _columns(header)
        ends = np.cumsum(form_sizes(columns.lens, columns.widths))  # each chunk's, in the section
        if size - body - trailer != (int(ends[-1]) if len(ends) else 0):
            raise SnapshotError("token arena length does not match the header")
        tokens, filling = read_token_section(
            f, body, columns.lens, columns.widths, ends, header.version, digests, piece
        )
        try:
            table, sids = _shapes(header, columns)
            hashes = HashWords(header.chunk_hashes)  # (a hash's ``bytes`` made if read)
            # With blend on (it is never turned off), records the index will hold are built
            # marked, and the index built from the columns (directory/reindex.py).
            indexable = indexable_chunks(directory, header, columns)
            room = None if indexable is None else index_room(directory, indexable)
            parts = _build(header, columns, tokens, hashes, sids, indexable)
            counts = _counts(header, columns, sids)
            cursors, capacities = _cursors(header), _capacities(header)
            tenants = _tenants(header, columns, hashes)
            state = DirectoryState(header.chunk_size, cursors, capacities, tenants=tenants)
            index = None
            if room is not None:  # while the contents are filled
                index = built_index(room, header, columns, tokens, hashes, sids, table, filling)
            del tokens
        finally:  # nothing else reads a content before the whole section is in
            if filling is not None:
                filling.finish()
        shapes, position = len(columns.key_shapes), header.stream_position
        instances, sections, chunks = header.instances, header.sections, len(hashes)
        # the header's buffer (its columns and the hashes are views of it) goes first
        del header, columns, filling, hashes
        directory.install(Restored(state, table, parts, counts, index))
    return SnapshotInfo(
        str(path),
        chunks,
        shapes,
        size,
        time.perf_counter() - started,
        0.0,
        position,
        instances,
        sections,
    )


def read_header(f: io.FileIO, size: int) -> tuple[Header[memoryview], int]:
    """The header of the snapshot open as ``f`` (unbuffered, at its start; ``size`` bytes)
    and where its token section starts. The header's columns are read-only views of the one
    buffer read (``Header[memoryview]``: no copy of them)."""
    header, body, _, _ = _read_header(f, size)
    return header, body


def _read_header(f: io.FileIO, size: int) -> tuple[Header[memoryview], int, memoryview, memoryview]:
    """:func:`read_header`, and the prefix and header bytes read (their checksum's)."""
    prefix = read_exactly(f, PREFIX.size)
    if len(prefix) < PREFIX.size:
        raise SnapshotError("file too short for a snapshot")
    magic, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise SnapshotError("not a kvatlas snapshot (bad magic)")
    body = PREFIX.size + header_len
    if body > size:
        raise SnapshotError("truncated snapshot header")
    raw = read_exactly(f, header_len)
    if len(raw) != header_len:
        raise SnapshotError("truncated snapshot header")
    try:
        header = msgspec.msgpack.decode(raw, type=Header[memoryview])
    except msgspec.MsgspecError as exc:
        raise SnapshotError(f"corrupt snapshot header: {exc}") from None
    if header.version not in READABLE:
        raise SnapshotError(f"unsupported snapshot version {header.version}")
    return header, body, prefix, raw


def _known_forms(widths: np.ndarray[Any, Any], version: int) -> np.ndarray[Any, Any]:
    """Which form codes the snapshot's version may hold (planes forms from version 3 on)."""
    known: np.ndarray[Any, Any] = (widths == FORM_U16) | (widths == FORM_U32)
    if version >= 3:
        known |= (widths > FORM_PLANES) & (widths <= FORM_PLANES + MAX_HIGH_BITS)
    return known


def _columns(header: Header[memoryview]) -> Columns:
    offsets = decode_column(header, "chunk_offsets")
    lens = decode_column(header, "chunk_token_lens")
    counts = decode_column(header, "chunk_key_counts")
    key_shapes = decode_column(header, "key_shapes")
    key_pl_counts = decode_column(header, "key_pl_counts")
    key_pls = decode_column(header, "key_pls")
    n = len(offsets)
    n_pls = len(decode_column(header, "pl_instance"))
    widths = decode_column(header, "chunk_token_widths").astype(np.int64)
    if header.version < 2 or not len(widths):  # version 1: every token is a uint32
        widths = np.full(n, 4, np.int64)
    if (
        len(header.chunk_hashes) != HASH_BYTES * n
        or len(lens) != n
        or len(counts) != n
        or int(counts.sum(dtype=np.int64)) != len(key_shapes)
        or len(key_pl_counts) != len(key_shapes)
        or int(key_pl_counts.sum(dtype=np.int64)) != len(key_pls)
        or int(lens.sum(dtype=np.int64)) != header.arena_tokens
        or len(widths) != n
        or (n and not bool(_known_forms(widths, header.version).all()))
        or (n and (int(offsets.min()) < -1 or int(counts.min()) < 1))
        or (len(key_shapes) and int(key_shapes.max()) >= len(header.shapes))
        or (len(key_pl_counts) and int(key_pl_counts.min()) < 1)
        or (len(key_pls) and int(key_pls.max()) >= n_pls)
    ):
        raise SnapshotError("inconsistent snapshot columns")
    counts = counts.astype(np.int64)
    first_key = np.cumsum(counts) - counts
    return Columns(offsets, lens, widths, counts, first_key, key_shapes, key_pl_counts, key_pls)


def _shapes(header: Header[memoryview], cols: Columns) -> tuple[ShapeTable, npt.NDArray[np.int64]]:
    """The directory's shape table, and each key's shape id in it."""
    strings = header.strings
    table = ShapeTable()
    try:
        ids = [
            table.intern(ObjectKey(bytes(32), strings[model], kv_rank, group, strings[salt]))
            for model, kv_rank, group, salt in header.shapes
        ]
    except (ValueError, IndexError) as exc:
        raise SnapshotError(f"invalid key shape in snapshot: {exc}") from None
    return table, np.asarray(ids, dtype=np.int64)[cols.key_shapes]


def _placements(header: Header[memoryview]) -> list[PlacementRow]:
    names = ("pl_instance", "pl_incarnation", "pl_tier", "pl_backend", "pl_size")
    instance, incarnation, tier, backend, size = (decode_column(header, n) for n in names)
    shared, access = decode_column(header, "pl_shared"), decode_column(header, "pl_access")
    n = len(instance)
    if any(len(c) != n for c in (incarnation, tier, backend, size, shared, access)):
        raise SnapshotError("placement columns differ in length")
    if not n:
        return []
    strings = header.strings
    if (
        int(max(instance.max(), backend.max())) >= len(strings)
        or int(tier.max()) >= len(TIERS)
        or int(size.min()) < 0
    ):
        raise SnapshotError("placement column out of range")
    table = np.empty(len(strings), dtype=object)
    table[:] = strings
    tiers = np.empty(len(TIERS), dtype=object)
    tiers[:] = TIERS
    return rows_from_columns(
        table[instance].tolist(),
        incarnation.tolist(),
        tiers[tier].tolist(),
        table[backend].tolist(),
        size.tolist(),
        (shared != 0).tolist(),
        access.tolist(),
    )


def _build(
    header: Header[memoryview],
    cols: Columns,
    tokens: list[Any],
    hashes: HashWords,
    sids: npt.NDArray[np.int64],
    marks: npt.NDArray[np.bool_] | None,
) -> list[ChunkPart]:
    """The partitions of records (``sids``: each key's shape id), marked indexed where
    ``marks`` says (``None``: none; ``blend_build.indexable_chunks``), as the table's
    columns: no record built but for chunks with several keys or placements (then the
    record is written over)."""
    pls = _placements(header)
    # Column-wise: each chunk's first key, that key's first placement, its shape id.
    counts, first_key = cols.counts, cols.first_key
    kpc = cols.key_pl_counts.astype(np.int64)
    key_first_ref = np.cumsum(kpc) - kpc  # each key's first placement reference
    first_ref = key_first_ref[first_key]
    simple = (counts == 1) & (kpc[first_key] == 1)  # one key, one placement: most chunks
    rows = np.fromiter(pls, dtype=object, count=len(pls))  # gathered in C, not per chunk
    flagged = sids[first_key] << 1
    if marks is not None:
        flagged += marks
    first = np.frombuffer(header.chunk_hashes, dtype=np.uint8)[::HASH_BYTES]
    n = len(hashes)
    offsets, first_pl = cols.offsets.astype(np.int64), cols.key_pls[first_ref]
    in_order_tokens = tokens
    words = np.frombuffer(header.chunk_hashes, np.uint64).reshape(n, HASH_BYTES // 8)
    if n and not bool((first[1:] >= first[:-1]).all()):  # not as written: sorted (stable)
        order = np.argsort(first, kind="stable")
        words = words[order]
        first, offsets, flagged, first_pl = (
            first[order],
            offsets[order],
            flagged[order],
            first_pl[order],
        )
        in_order_tokens = [tokens[i] for i in order.tolist()]
    # (the partitions' first bytes as uint8 too: an int64 query would cast all n of ``first``)
    bounds = [*np.searchsorted(first, np.arange(PARTS, dtype=np.uint8)).tolist(), n]
    parts = parts_of_columns(
        PARTS,
        words,  # (the hashes as the file's words: the maps copy them, no object read)
        bounds, in_order_tokens, offsets, flagged.tolist(), rows[first_pl].tolist(),
        _l1_owners(header)[first_pl], header.strings,
        int(np.count_nonzero(cols.lens)),  # (the known contents: a chunk of no ids has none)
    )  # fmt: skip
    if sum(map(len, parts)) != n:
        raise SnapshotError("duplicate chunk hashes in snapshot")
    if not simple.all():
        ksh, kpl, kpc_list = sids.tolist(), cols.key_pls.tolist(), kpc.tolist()
        fk, fr = first_key.tolist(), key_first_ref.tolist()
        counts_list = cols.counts.tolist()
        for c in np.flatnonzero(~simple).tolist():
            keys: list[KeyPair] = []
            for k in range(fk[c], fk[c] + counts_list[c]):
                m = fr[k]
                keys.append((ksh[k], group_placements([pls[x] for x in kpl[m : m + kpc_list[k]]])))
            h = hashes[c]
            part = parts[h[0]]
            rec = part[h]
            part[h] = make_record(
                record_stored_tokens(rec), record_offset(rec), record_indexed(rec), keys
            )
    return parts


def _l1_owners(header: Header[memoryview]) -> npt.NDArray[np.int64]:
    """Each placement row's :func:`~kvatlas.directory.records.l1_owner`, as an index of the
    header's strings (-1: none)."""
    tier = decode_column(header, "pl_tier").astype(np.int64)
    shared = decode_column(header, "pl_shared") != 0
    own = np.isin(tier, [TIERS.index(t) for t in VOLATILE_TIERS]) & ~shared
    return np.where(own, decode_column(header, "pl_instance").astype(np.int64), -1)


def _cursors(header: Header[memoryview]) -> dict[str, EmitterCursor]:
    out = {}
    for name, inc, last_seq, gaps, missing, last in header.cursors:
        gap = None if last is None else GapRecord(*last)
        out[name] = EmitterCursor(inc, last_seq, gaps, missing, gap)
    return out


def _tenants(header: Header[memoryview], cols: Columns, hashes: HashWords) -> dict[bytes, Bindings]:
    """An entry for each chunk held under keys of several salts, with the bindings saved
    (version >= 7; an older file's one binding for all of a chunk's salts is dropped at the
    install, ``ChunkTable.adopt_tenants``). A binding of another chunk, or of a salt without
    keys of the chunk, or one given twice, is refused."""
    rows = header.tenant_bindings
    if not len(cols.counts) or (int(cols.counts.max()) < 2 and not rows):
        return {}
    salts = np.array([shape[3] for shape in header.shapes], np.int64)[cols.key_shapes]
    chunks = np.repeat(np.arange(len(cols.counts)), cols.counts)
    many = np.unique(chunks[salts != np.repeat(salts[cols.first_key], cols.counts)]).tolist()
    out: dict[bytes, dict[str, Binding]] = {hashes[c]: {} for c in many}
    key_salts = {}  # of the chunks of several salts: their keys' salts
    if rows:
        strings, first = header.strings, cols.first_key
        for c in many:
            at = int(first[c])
            key_salts[hashes[c]] = {strings[s] for s in salts[at : at + int(cols.counts[c])]}
    for h, salt, ids, offset in rows:
        bindings = out.get(h)
        if (
            bindings is None
            or salt in bindings
            or salt not in key_salts[h]
            or not ids
            or len(ids) % 4
            or offset < -1
        ):
            raise SnapshotError(f"invalid binding of chunk {bytes(h).hex()} for salt {salt!r}")
        bindings[salt] = (stored_one(np.frombuffer(ids, "<u4")), offset)
    tenants: dict[bytes, Bindings] = dict(out)
    return tenants


def _capacities(header: Header[memoryview]) -> dict[str, CapacityDeclaration]:
    return {
        inst: CapacityDeclaration(inc, rev, {(t, b): n for t, b, n in caps})
        for inst, inc, rev, caps in header.capacities
    }


def _counts(header: Header[memoryview], cols: Columns, sids: npt.NDArray[np.int64]) -> ChunkCounts:
    """:class:`ChunkCounts` computed column-wise (no pass over the records): first how many
    keys reference each placement row (rows are shared: one per batch and size, so there are
    few), then everything per row. ``sids``: each key's interned shape id."""
    strings = header.strings
    tier = decode_column(header, "pl_tier").astype(np.int64)
    size = decode_column(header, "pl_size").astype(np.int64)
    shared = decode_column(header, "pl_shared") != 0
    instance = decode_column(header, "pl_instance").astype(np.int64)
    backend = decode_column(header, "pl_backend").astype(np.int64)
    refs = cols.key_pls
    uses = np.bincount(refs, minlength=len(tier))  # references of each placement row
    used = np.flatnonzero(uses)
    by_tier: Counter[str] = Counter()
    for t, n_bytes in _sums(tier[used], uses[used] * size[used]):
        by_tier[TIERS[t]] = n_bytes
    own_l1 = np.isin(tier, [TIERS.index(t) for t in VOLATILE_TIERS]) & ~shared
    l1_counts: Counter[str] = Counter()
    own_rows = np.flatnonzero(own_l1 & (uses > 0))
    for inst, n in _sums(instance[own_rows], uses[own_rows]):
        l1_counts[strings[inst]] = n
    # modules: (owner + 1, 0 for a shared pool; tier; backend) as one int64 per row
    n_strings = len(strings)
    owner = np.where(shared, 0, instance + 1)[used]
    module = (owner * len(TIERS) + tier[used]) * n_strings + backend[used]
    module_placements: Counter[Module] = Counter()
    module_bytes: Counter[Module] = Counter()
    placements = dict(_sums(module, uses[used]))
    for k, n_bytes in _sums(module, uses[used] * size[used]):
        rest, b = divmod(k, n_strings)
        o, t = divmod(rest, len(TIERS))
        name = (None if o == 0 else strings[o - 1], TIERS[t], strings[b])
        module_placements[name] = placements[k]
        module_bytes[name] = n_bytes
    # L2 bytes per key shape: each reference's key's shape, over the L2 references
    l2_by_shape: Counter[int] = Counter()
    l2_refs = tier[refs] == TIERS.index(L2_TIER)
    if bool(l2_refs.any()):
        ref_key = np.repeat(np.arange(len(sids)), cols.key_pl_counts)
        for sid, n_bytes in _sums(sids[ref_key[l2_refs]], size[refs[l2_refs]]):
            l2_by_shape[sid] = n_bytes
    return ChunkCounts(
        len(cols.key_shapes),
        len(refs),
        l1_counts,
        by_tier,
        module_placements,
        module_bytes,
        l2_bytes_by_shape=l2_by_shape,
    )


def _sums(keys: npt.NDArray[np.int64], values: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """``(key, sum of its values)`` for each distinct key, ascending."""
    if not len(keys):
        return []
    distinct, where = np.unique(keys, return_inverse=True)
    totals = np.zeros(len(distinct), np.int64)
    np.add.at(totals, where, values.astype(np.int64))
    return list(zip(distinct.tolist(), totals.tolist(), strict=True))
