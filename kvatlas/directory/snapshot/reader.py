"""Reading snapshots: all or nothing, column-wise.

:func:`load_snapshot` either installs the whole snapshot or raises :class:`SnapshotError` and
leaves the directory as it was: every column is checked against the others before anything is
built. Restore works column-wise: vectorised checks, records zipped from columns (a Python loop
only for chunks with several keys or placements), partitions built from the file's partition
order, counters and L1 sets computed from the columns instead of a pass over the records. Token
ids are scattered straight from the file into one private read-only array per content. See
docs/directory.md.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from operator import methodcaller
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.directory.capture import DirectoryState, Restored
from kvatlas.directory.chunk_counts import PARTS, ChunkCounts, Partition
from kvatlas.directory.gate import EmitterCursor, GapRecord
from kvatlas.directory.key_directory import KeyDirectory
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPair,
    Module,
    PlacementRow,
    Record,
    group_placements,
    make_record,
    record_indexed,
    record_offset,
    record_stored_tokens,
    records_from_columns,
    rows_from_columns,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.snapshot.format import (
    HASH_BYTES,
    MAGIC,
    PREFIX,
    READABLE,
    TIERS,
    Header,
    SnapshotError,
    SnapshotInfo,
    decode_column,
)
from kvatlas.directory.token_store import stored_batch
from kvatlas.events import UNKNOWN_OFFSET, VOLATILE_TIERS
from kvatlas.keys import ObjectKey

_READ_ONLY = methodcaller("setflags", write=False)
_U16, _U32 = np.dtype(np.uint16), np.dtype(np.uint32)
_preadv: Callable[[int, list[Any], int], int] | None = getattr(os, "preadv", None)
try:
    _IOV_MAX = max(1, min(int(os.sysconf("SC_IOV_MAX")), 1024))
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    _IOV_MAX = 16


def load_snapshot(directory: KeyDirectory, path: str | os.PathLike[str]) -> SnapshotInfo:
    """Replace ``directory``'s state with the snapshot at ``path``; rebuild the blend index
    from the restored bindings if blend lookup is on. Raises :class:`SnapshotError`."""
    started = time.perf_counter()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(PREFIX.size)
        if len(prefix) < PREFIX.size:
            raise SnapshotError("file too short for a snapshot")
        magic, header_len = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SnapshotError("not a kvatlas snapshot (bad magic)")
        body = PREFIX.size + header_len
        if body > size:
            raise SnapshotError("truncated snapshot header")
        raw_header = f.read(header_len)
        if len(raw_header) != header_len:
            raise SnapshotError("truncated snapshot header")
        try:
            header = msgspec.msgpack.decode(raw_header, type=Header)
        except msgspec.MsgspecError as exc:
            raise SnapshotError(f"corrupt snapshot header: {exc}") from None
        del raw_header
        if header.version not in READABLE:
            raise SnapshotError(f"unsupported snapshot version {header.version}")
        columns = _columns(header)
        if size - body != int((columns.lens.astype(np.int64) * columns.widths).sum()):
            raise SnapshotError("token arena length does not match the header")
        # The GC stays on: records are untracked at their first young collection, so
        # collecting as they are built costs less than one pass over all of them at the end.
        tokens = _read_tokens(f, body, columns.lens, columns.widths, header.version < 2)
        # with blend on (it is never turned off), records the index will hold are built
        # marked: the rebuild then makes no second record per chunk (directory/reindex.py)
        blend = directory.blend_enabled and header.chunk_size == directory.chunk_size
        shapes, parts, hashes = _build(header, columns, tokens, blend)
        del tokens
        state = DirectoryState(header.chunk_size, _cursors(header), _capacities(header))
        counts = _counts(header, columns, hashes)
        directory.install(Restored(state, shapes, parts, counts))
    return SnapshotInfo(
        str(path),
        len(hashes),
        len(columns.key_shapes),
        size,
        time.perf_counter() - started,
        0.0,
        header.stream_position,
        header.instances,
    )


@dataclass(frozen=True, slots=True)
class _Columns:
    """The chunk and key columns of a header, checked for consistency."""

    offsets: np.ndarray[Any, Any]
    lens: np.ndarray[Any, Any]
    widths: np.ndarray[Any, Any]  # bytes per token (int64: 2 or 4)
    counts: np.ndarray[Any, Any]
    key_shapes: np.ndarray[Any, Any]
    key_pl_counts: np.ndarray[Any, Any]
    key_pls: np.ndarray[Any, Any]


def _columns(header: Header) -> _Columns:
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
        or (n and not bool(((widths == 2) | (widths == 4)).all()))
        or (n and (int(offsets.min()) < -1 or int(counts.min()) < 1))
        or (len(key_shapes) and int(key_shapes.max()) >= len(header.shapes))
        or (len(key_pl_counts) and int(key_pl_counts.min()) < 1)
        or (len(key_pls) and int(key_pls.max()) >= n_pls)
    ):
        raise SnapshotError("inconsistent snapshot columns")
    return _Columns(offsets, lens, widths, counts, key_shapes, key_pl_counts, key_pls)


def _read_tokens(
    f: io.BufferedReader,
    start: int,
    lens: np.ndarray[Any, Any],
    widths: np.ndarray[Any, Any],
    compact: bool,
) -> list[Any]:
    """One private read-only array per bound chunk (``None`` for unknown content), at its
    stored width, filled straight from the file: scatter reads (``preadv``, up to ``IOV_MAX``
    arrays per call) put the arena into the final arrays with no intermediate buffer. A
    version-1 arena (``compact``: every width 4) is compacted as it is read, a group at a
    time (see :mod:`kvatlas.directory.token_store`).

    Each content owns its memory, rather than being a view into one arena buffer: a view would
    pin the whole arena for as long as any restored chunk lives (L2 placements can live for
    days), and the blend index could not share it (it copies arrays that pin a larger buffer),
    doubling token memory."""
    lens_list = lens.tolist()
    if not lens_list:
        return []
    bound = lens > 0
    sizes = (lens[bound] * widths[bound]).tolist()  # bytes of each bound chunk
    dtypes = [_U16 if w == 2 else _U32 for w in widths[bound].tolist()]
    counts = lens[bound].tolist()
    fd = f.fileno()
    step = _IOV_MAX if _preadv is not None else 1
    arrays: list[Any] = []
    pos = start
    for i in range(0, len(counts), step):
        group: list[Any] = list(map(np.empty, counts[i : i + step], dtypes[i : i + step]))
        want = sum(sizes[i : i + step])
        got = _preadv(fd, group, pos) if _preadv is not None else 0
        if got != want:  # short read (huge group) or no preadv: fill array by array
            at = pos
            for a in group:
                _fill(f, a, at)
                at += a.nbytes
        pos += want
        if sys.byteorder != "little":  # pragma: no cover - the arena is little-endian
            for a in group:
                a.byteswap(inplace=True)
        deque(map(_READ_ONLY, group), maxlen=0)
        arrays += stored_batch(group) if compact else group
    if len(arrays) == len(lens_list):  # every chunk bound: the common case
        return arrays
    it = iter(arrays)
    return [next(it) if n else None for n in lens_list]


def _fill(f: io.BufferedReader, a: np.ndarray[Any, Any], pos: int) -> None:
    view = a.data.cast("B")
    f.seek(pos)
    filled = 0
    while filled < len(view):
        got = f.readinto(view[filled:])
        if not got:
            raise SnapshotError("truncated snapshot token arena")
        filled += got


def _shapes(header: Header) -> tuple[list[int], ShapeTable]:
    """Snapshot shape id -> directory shape id, and the directory's shape table."""
    strings = header.strings
    table = ShapeTable()
    try:
        ids = [
            table.intern(ObjectKey(bytes(32), strings[model], kv_rank, group, strings[salt]))
            for model, kv_rank, group, salt in header.shapes
        ]
    except (ValueError, IndexError) as exc:
        raise SnapshotError(f"invalid key shape in snapshot: {exc}") from None
    return ids, table


def _placements(header: Header) -> list[PlacementRow]:
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
    header: Header, cols: _Columns, tokens: list[Any], blend: bool
) -> tuple[ShapeTable, list[Partition], list[bytes]]:
    """The shape table, the partitions of records, and every chunk's hash; with ``blend``,
    the records of indexable chunks (content of ``chunk_size`` tokens, a known offset) are
    marked indexed."""
    snap_to_sid, table = _shapes(header)
    pls = _placements(header)
    raw = header.chunk_hashes
    hashes: list[bytes] = np.frombuffer(raw, dtype=f"V{HASH_BYTES}").tolist()  # exact bytes
    # Column-wise: each chunk's first key, that key's first placement, its shape id.
    counts = cols.counts.astype(np.int64)
    kpc = cols.key_pl_counts.astype(np.int64)
    first_key = np.cumsum(counts) - counts
    key_first_ref = np.cumsum(kpc) - kpc  # each key's first placement reference
    first_ref = key_first_ref[first_key]
    sids = np.asarray(snap_to_sid, dtype=np.int64)[cols.key_shapes]
    simple = (counts == 1) & (kpc[first_key] == 1)  # one key, one placement: most chunks
    records = records_from_columns(
        tokens,
        cols.offsets.tolist(),
        sids[first_key].tolist(),
        map(pls.__getitem__, cols.key_pls[first_ref].tolist()),
        _indexable(header, cols).tolist() if blend else None,
    )
    if not simple.all():
        ksh, kpl, kpc_list = sids.tolist(), cols.key_pls.tolist(), kpc.tolist()
        fk, fr = first_key.tolist(), key_first_ref.tolist()
        counts_list = cols.counts.tolist()
        for c in np.flatnonzero(~simple).tolist():
            keys: list[KeyPair] = []
            for k in range(fk[c], fk[c] + counts_list[c]):
                m = fr[k]
                keys.append((ksh[k], group_placements([pls[x] for x in kpl[m : m + kpc_list[k]]])))
            rec = records[c]
            records[c] = make_record(
                record_stored_tokens(rec), record_offset(rec), record_indexed(rec), keys
            )
    return table, _partitions(raw, hashes, records), hashes


def _indexable(header: Header, cols: _Columns) -> npt.NDArray[np.bool_]:
    """Chunks the blend index holds: bound content of ``chunk_size`` tokens, a known offset
    (``ChunkTable._indexable``)."""
    out: npt.NDArray[np.bool_] = (cols.lens == header.chunk_size) & (cols.offsets != UNKNOWN_OFFSET)
    return out


def _partitions(raw: bytes, hashes: list[bytes], records: list[Record]) -> list[Partition]:
    n = len(hashes)
    parts: list[Partition]
    first = np.frombuffer(raw, dtype=np.uint8)[::HASH_BYTES]
    if n and bool((first[1:] >= first[:-1]).all()):  # as written: in partition order
        bounds = np.searchsorted(first, np.arange(PARTS + 1)).tolist()
        parts = [
            dict(zip(hashes[lo:hi], records[lo:hi], strict=True)) for lo, hi in pairwise(bounds)
        ]
    else:
        parts = [{} for _ in range(PARTS)]
        for h, rec in zip(hashes, records, strict=True):
            parts[h[0]][h] = rec
    if sum(len(p) for p in parts) != n:
        raise SnapshotError("duplicate chunk hashes in snapshot")
    return parts


def _cursors(header: Header) -> dict[str, EmitterCursor]:
    out = {}
    for name, inc, last_seq, gaps, missing, last in header.cursors:
        gap = None if last is None else GapRecord(*last)
        out[name] = EmitterCursor(inc, last_seq, gaps, missing, gap)
    return out


def _capacities(header: Header) -> dict[str, CapacityDeclaration]:
    return {
        inst: CapacityDeclaration(inc, rev, {(t, b): n for t, b, n in caps})
        for inst, inc, rev, caps in header.capacities
    }


def _counts(header: Header, cols: _Columns, hashes: list[bytes]) -> ChunkCounts:
    """:class:`ChunkCounts` computed column-wise (no pass over the records); the L1 sets hold
    the same hash objects as the partitions."""
    strings = header.strings
    refs = cols.key_pls.astype(np.int64)
    tier = decode_column(header, "pl_tier")[refs]
    size = decode_column(header, "pl_size")[refs]
    shared = decode_column(header, "pl_shared")[refs]
    instance = decode_column(header, "pl_instance")[refs]
    chunk_of_key = np.repeat(np.arange(len(cols.counts)), cols.counts)
    chunk_of_ref = np.repeat(chunk_of_key, cols.key_pl_counts)
    by_tier: Counter[str] = Counter()
    for t, name in enumerate(TIERS):
        mask = tier == t
        if mask.any():
            by_tier[name] = int(size[mask].sum())
    volatile = [TIERS.index(t) for t in VOLATILE_TIERS]
    own_l1 = np.isin(tier, volatile) & (shared == 0)
    l1_counts: Counter[str] = Counter()
    l1_chunks: dict[str, set[bytes]] = {}
    per_instance = np.bincount(instance[own_l1], minlength=len(strings))
    for inst in np.flatnonzero(per_instance).tolist():
        mask = own_l1 & (instance == inst)
        l1_counts[strings[inst]] = int(per_instance[inst])
        chunks = chunk_of_ref[mask]
        if len(chunks) == len(hashes) and bool((chunks == np.arange(len(hashes))).all()):
            l1_chunks[strings[inst]] = set(hashes)  # one copy of every chunk: no indexing
        else:
            l1_chunks[strings[inst]] = set(map(hashes.__getitem__, chunks.tolist()))
    module_placements, module_bytes = _module_counts(header, refs, instance, tier, shared, size)
    return ChunkCounts(
        len(cols.key_shapes),
        len(refs),
        l1_counts,
        by_tier,
        l1_chunks,
        module_placements,
        module_bytes,
    )


def _module_counts(
    header: Header,
    refs: npt.NDArray[np.int64],
    instance: npt.NDArray[Any],
    tier: npt.NDArray[Any],
    shared: npt.NDArray[Any],
    size: npt.NDArray[Any],
) -> tuple[Counter[Module], Counter[Module]]:
    """Placements and bytes per module, grouped column-wise: one int64 per placement
    (owner + 1, 0 for a shared pool; tier; backend), sorted once, summed per run."""
    strings = header.strings
    n_strings = len(strings)
    backend = decode_column(header, "pl_backend")[refs].astype(np.int64)
    owner = np.where(shared != 0, 0, instance.astype(np.int64) + 1)
    key = (owner * len(TIERS) + tier.astype(np.int64)) * n_strings + backend
    placements: Counter[Module] = Counter()
    used: Counter[Module] = Counter()
    if not len(key):
        return placements, used
    order = np.argsort(key, kind="stable")
    key = key[order]
    starts = np.concatenate(([0], np.flatnonzero(key[1:] != key[:-1]) + 1))
    counts = np.diff(np.append(starts, len(key)))
    sums = np.add.reduceat(size[order].astype(np.int64), starts)
    for k, n, nbytes in zip(key[starts].tolist(), counts.tolist(), sums.tolist(), strict=True):
        rest, b = divmod(k, n_strings)
        o, t = divmod(rest, len(TIERS))
        module = (None if o == 0 else strings[o - 1], TIERS[t], strings[b])
        placements[module] = n
        used[module] = nbytes
    return placements, used
