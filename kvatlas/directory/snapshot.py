"""Directory snapshots: durable, atomically written, quick to take and fast to restore.

Taking: copy-on-write by partition (see ``KeyDirectory._snapshot_part``). The directory lock
is held for one of 256 partitions at a time (≈1 ms at 1M keys), never for the whole
directory; changes made meanwhile save the snapshot-start state of what they touch first.
Serialisation and I/O run outside the lock.

Format: ``MAGIC | u64 header length | msgpack header | token arena``. The header is columnar
(numpy arrays as raw little-endian bytes, interned string/shape/placement tables) so restore is
column-wise: vectorised checks, records zipped from columns (a Python loop only for chunks with
several keys or placements), partitions built from the file's partition order. Token ids
follow as one arena, scattered straight into one private read-only array per content (see
``_read_tokens``). The blend index is not stored: it is rebuilt from the bindings
when blend lookup is on. Written as temp file + fsync + rename + directory fsync, so a crash
leaves the previous snapshot intact.
"""

from __future__ import annotations

import io
import os
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import methodcaller
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvatlas.directory.gate import EmitterCursor, GapRecord
from kvatlas.directory.key_directory import (
    PARTS,
    DirectoryState,
    KeyDirectory,
    RestoredCounts,
    ShapeParts,
)
from kvatlas.directory.records import (
    KEYS,
    OFFSET,
    TOKENS,
    CapacityDeclaration,
    KeyShape,
    PlacementRow,
    Record,
    placements_of,
)
from kvatlas.keys import BlendNamespace, ObjectKey

MAGIC = b"KVATSNP1"
VERSION = 1
_PREFIX = struct.Struct("<8sQ")
_TIERS = ("l1", "l2")
_READ_ONLY = methodcaller("setflags", write=False)
_preadv: Callable[[int, list[Any], int], int] | None = getattr(os, "preadv", None)
try:
    _IOV_MAX = max(1, min(int(os.sysconf("SC_IOV_MAX")), 1024))
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    _IOV_MAX = 16


class SnapshotError(ValueError):
    """The snapshot file is not a valid kvatlas snapshot (truncated, corrupt, foreign)."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    path: str
    chunks: int
    keys: int
    bytes: int
    seconds: float
    max_pause_s: float  # longest single hold of the directory lock (0 for restore)
    stream_position: str | None


class _Header(msgspec.Struct):
    version: int
    chunk_size: int
    stream_position: str | None
    strings: list[str]
    shapes: list[tuple[int, int, int, int]]  # model string, kv_rank, group id, salt string
    pl_instance: bytes  # u32 string refs
    pl_incarnation: bytes  # u64
    pl_tier: bytes  # u8
    pl_backend: bytes  # u32 string refs
    pl_size: bytes  # i64
    pl_shared: bytes  # u8
    pl_access: bytes  # f64
    chunk_hashes: bytes  # 32 bytes per chunk
    chunk_offsets: bytes  # i64
    chunk_token_lens: bytes  # u32 (0 = content unknown)
    chunk_key_counts: bytes  # u32
    key_shapes: bytes  # u32 shape refs
    key_pl_counts: bytes  # u32
    key_pls: bytes  # u32 placement refs
    cursors: list[tuple[str, int, int, int, int, tuple[int, int, int] | None]]
    capacities: list[tuple[str, int, int, list[tuple[str, str, int]]]]
    arena_tokens: int


def _arr(raw: bytes, dtype: str, name: str) -> np.ndarray[Any, Any]:
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise SnapshotError(f"column {name} has a length that is not a multiple of {size}")
    return np.frombuffer(raw, dtype=dtype)


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = []
        self.ids: dict[str, int] = {}

    def ref(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.table)
            self.table.append(s)
        return i


def save_snapshot(
    directory: KeyDirectory, path: str | os.PathLike[str], *, stream_position: str | None = None
) -> SnapshotInfo:
    """Write a consistent snapshot of ``directory`` to ``path`` (atomically)."""
    started = time.perf_counter()
    strings = _Strings()
    shape_ids: dict[int, int] = {}  # directory shape id -> snapshot shape id
    shapes: list[tuple[int, int, int, int]] = []
    pl_ids: dict[int, int] = {}
    pls: list[PlacementRow] = []
    hashes: list[bytes] = []
    offsets: list[int] = []
    token_lens: list[int] = []
    arena: list[np.ndarray[Any, Any]] = []
    key_counts: list[int] = []
    key_shapes: list[int] = []
    key_pl_counts: list[int] = []
    key_pls: list[int] = []
    max_pause = 0.0
    state = directory._snapshot_begin()
    table = state.shapes
    try:
        for part_no in range(PARTS):
            rows, held = directory._snapshot_part(part_no)
            max_pause = max(max_pause, held)
            for h, rec in rows:
                hashes.append(h)
                offsets.append(rec[OFFSET])
                tokens = rec[TOKENS]
                if tokens is None:
                    token_lens.append(0)
                else:
                    token_lens.append(len(tokens))
                    arena.append(tokens)
                key_counts.append((len(rec) - KEYS) >> 1)
                for j in range(KEYS, len(rec), 2):
                    sid = shape_ids.get(rec[j])
                    if sid is None:
                        shape = table[rec[j]]
                        sid = shape_ids[rec[j]] = len(shapes)
                        shapes.append(
                            (
                                strings.ref(shape.model_name),
                                shape.kv_rank,
                                shape.object_group_id,
                                strings.ref(shape.cache_salt),
                            )
                        )
                    key_shapes.append(sid)
                    group = placements_of(rec[j + 1])
                    key_pl_counts.append(len(group))
                    for p in group:
                        pid = pl_ids.get(id(p))
                        if pid is None:
                            pid = pl_ids[id(p)] = len(pls)
                            pls.append(p)
                        key_pls.append(pid)
    finally:
        directory._snapshot_end()
    header = _Header(
        version=VERSION,
        chunk_size=state.chunk_size,
        stream_position=stream_position,
        strings=[],
        shapes=shapes,
        pl_instance=_u32([strings.ref(p[0]) for p in pls]),
        pl_incarnation=np.array([p[1] for p in pls], dtype="<u8").tobytes(),
        pl_tier=np.array([_TIERS.index(p[2]) for p in pls], dtype="u1").tobytes(),
        pl_backend=_u32([strings.ref(p[3]) for p in pls]),
        pl_size=np.array([p[4] for p in pls], dtype="<i8").tobytes(),
        pl_shared=np.array([p[5] for p in pls], dtype="u1").tobytes(),
        pl_access=np.array([p[6] for p in pls], dtype="<f8").tobytes(),
        chunk_hashes=b"".join(hashes),
        chunk_offsets=np.array(offsets, dtype="<i8").tobytes(),
        chunk_token_lens=_u32(token_lens),
        chunk_key_counts=_u32(key_counts),
        key_shapes=_u32(key_shapes),
        key_pl_counts=_u32(key_pl_counts),
        key_pls=_u32(key_pls),
        cursors=[_cursor_row(name, c) for name, c in state.cursors.items()],
        capacities=[
            (inst, d.incarnation, d.revision, [(t, b, n) for (t, b), n in d.capacities.items()])
            for inst, d in state.capacities.items()
        ],
        arena_tokens=sum(token_lens),
    )
    header.strings = strings.table
    size = _write_atomically(Path(path), msgspec.msgpack.encode(header), arena)
    return SnapshotInfo(
        str(path),
        len(hashes),
        len(key_shapes),
        size,
        time.perf_counter() - started,
        max_pause,
        stream_position,
    )


def _u32(values: list[int]) -> bytes:
    return np.array(values, dtype="<u4").tobytes()


def _cursor_row(
    name: str, c: EmitterCursor
) -> tuple[str, int, int, int, int, tuple[int, int, int] | None]:
    gap = c.last_gap
    last = None if gap is None else (gap.incarnation, gap.after_seq, gap.seq)
    return (name, c.incarnation, c.last_seq, c.gaps, c.missing_batches, last)


def _write_atomically(path: Path, header: bytes, arena: list[np.ndarray[Any, Any]]) -> int:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, len(header)))
            f.write(header)
            for start in range(0, len(arena), 4096):
                block = arena[start : start + 4096]
                if block:
                    f.write(np.concatenate(block).astype("<u4", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def load_snapshot(directory: KeyDirectory, path: str | os.PathLike[str]) -> SnapshotInfo:
    """Replace ``directory``'s state with the snapshot at ``path``; rebuild the blend index
    from the restored bindings if blend lookup is on. Raises :class:`SnapshotError`."""
    started = time.perf_counter()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise SnapshotError("file too short for a snapshot")
        magic, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SnapshotError("not a kvatlas snapshot (bad magic)")
        body = _PREFIX.size + header_len
        if body > size:
            raise SnapshotError("truncated snapshot header")
        raw_header = f.read(header_len)
        if len(raw_header) != header_len:
            raise SnapshotError("truncated snapshot header")
        try:
            header = msgspec.msgpack.decode(raw_header, type=_Header)
        except msgspec.MsgspecError as exc:
            raise SnapshotError(f"corrupt snapshot header: {exc}") from None
        del raw_header
        if header.version != VERSION:
            raise SnapshotError(f"unsupported snapshot version {header.version}")
        if size - body != 4 * header.arena_tokens:
            raise SnapshotError("token arena length does not match the header")
        columns = _columns(header)
        # The GC stays on: records are untracked at their first young collection, so
        # collecting as they are built costs less than one pass over all of them at the end.
        tokens = _read_tokens(f, body, columns.lens)
        parts, shapes, shape_list, hashes = _build(header, columns, tokens)
        del tokens
        state = DirectoryState(header.chunk_size, _cursors(header), _capacities(header), shape_list)
        directory._install(parts, shapes, state, _derived(header, columns, hashes))
    return SnapshotInfo(
        str(path),
        len(hashes),
        len(columns.key_shapes),
        size,
        time.perf_counter() - started,
        0.0,
        header.stream_position,
    )


@dataclass(frozen=True, slots=True)
class _Columns:
    """The chunk and key columns of a header, checked for consistency."""

    offsets: np.ndarray[Any, Any]
    lens: np.ndarray[Any, Any]
    counts: np.ndarray[Any, Any]
    key_shapes: np.ndarray[Any, Any]
    key_pl_counts: np.ndarray[Any, Any]
    key_pls: np.ndarray[Any, Any]


def _columns(header: _Header) -> _Columns:
    offsets = _arr(header.chunk_offsets, "<i8", "chunk_offsets")
    lens = _arr(header.chunk_token_lens, "<u4", "chunk_token_lens")
    counts = _arr(header.chunk_key_counts, "<u4", "chunk_key_counts")
    key_shapes = _arr(header.key_shapes, "<u4", "key_shapes")
    key_pl_counts = _arr(header.key_pl_counts, "<u4", "key_pl_counts")
    key_pls = _arr(header.key_pls, "<u4", "key_pls")
    n = len(offsets)
    n_pls = len(header.pl_instance) // 4
    if (
        len(header.chunk_hashes) != 32 * n
        or len(lens) != n
        or len(counts) != n
        or int(counts.sum(dtype=np.int64)) != len(key_shapes)
        or len(key_pl_counts) != len(key_shapes)
        or int(key_pl_counts.sum(dtype=np.int64)) != len(key_pls)
        or int(lens.sum(dtype=np.int64)) != header.arena_tokens
        or (n and (int(offsets.min()) < -1 or int(counts.min()) < 1))
        or (len(key_shapes) and int(key_shapes.max()) >= len(header.shapes))
        or (len(key_pl_counts) and int(key_pl_counts.min()) < 1)
        or (len(key_pls) and int(key_pls.max()) >= n_pls)
    ):
        raise SnapshotError("inconsistent snapshot columns")
    return _Columns(offsets, lens, counts, key_shapes, key_pl_counts, key_pls)


def _read_tokens(f: io.BufferedReader, start: int, lens: np.ndarray[Any, Any]) -> list[Any]:
    """One private read-only array per bound chunk (``None`` for unknown content), filled
    straight from the file: scatter reads (``preadv``, up to ``IOV_MAX`` arrays per call) put
    the arena into the final arrays with no intermediate buffer.

    Each content owns its memory. Views into one arena were measured too (1M chunks): no faster
    here (0.9-2.5 s vs ≈1.0 s: a fresh 1 GiB buffer page-faults as much as the small arrays,
    which also reuse freed heap), and they would pin the whole arena for as long as any
    restored chunk lives (L2 placements can live for days) and could not be shared with the
    blend index (it copies arrays that pin a larger buffer), doubling token memory. Reading in
    a thread while the records are built was tried as well: no gain (each ``preadv`` has to
    win the GIL back from the building thread)."""
    lens_list = lens.tolist()
    empty, u32 = np.empty, np.uint32
    if not lens_list:
        return []
    first = lens_list[0]
    if first and lens_list.count(first) == len(lens_list):  # all bound, one length: common
        arrays = [empty(first, u32) for _ in lens_list]
        out: list[Any] = arrays
    else:
        out = [empty(n, u32) if n else None for n in lens_list]
        arrays = [a for a in out if a is not None]
    fd = f.fileno()
    ends = np.cumsum(lens[lens > 0], dtype=np.int64)  # token end of each array
    step = _IOV_MAX if _preadv is not None else 1
    done = 0  # tokens read so far
    for i in range(0, len(arrays), step):
        group = arrays[i : i + step]
        want = 4 * (int(ends[i + len(group) - 1]) - done)
        got = _preadv(fd, group, start + 4 * done) if _preadv is not None else 0
        if got != want:  # short read (huge group) or no preadv: fill array by array
            pos = start + 4 * done
            for a in group:
                _fill(f, a, pos)
                pos += a.nbytes
        done += want // 4
    if sys.byteorder != "little":  # pragma: no cover - the arena is little-endian
        for a in arrays:
            a.byteswap(inplace=True)
    deque(map(_READ_ONLY, arrays), maxlen=0)
    return out


def _fill(f: io.BufferedReader, a: np.ndarray[Any, Any], pos: int) -> None:
    view = a.data.cast("B")
    f.seek(pos)
    filled = 0
    while filled < len(view):
        got = f.readinto(view[filled:])
        if not got:
            raise SnapshotError("truncated snapshot token arena")
        filled += got


def _shapes(header: _Header) -> tuple[list[int], list[KeyShape], dict[ShapeParts, int]]:
    """Snapshot shape id -> directory shape id, the directory's shape table and its index."""
    strings = header.strings
    ids: list[int] = []
    table: list[KeyShape] = []
    interned: dict[ShapeParts, int] = {}
    try:
        for model_ref, kv_rank, group, salt_ref in header.shapes:
            key = ObjectKey(bytes(32), strings[model_ref], kv_rank, group, strings[salt_ref])
            parts = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
            sid = interned.get(parts)
            if sid is None:
                ns = BlendNamespace(key.model_name, key.cache_salt, key.world_size)
                sid = interned[parts] = len(table)
                table.append(KeyShape(*parts, ns))
            ids.append(sid)
    except (ValueError, IndexError) as exc:
        raise SnapshotError(f"invalid key shape in snapshot: {exc}") from None
    return ids, table, interned


def _placements(header: _Header) -> list[PlacementRow]:
    instance = _arr(header.pl_instance, "<u4", "pl_instance")
    tier = _arr(header.pl_tier, "u1", "pl_tier")
    backend = _arr(header.pl_backend, "<u4", "pl_backend")
    size = _arr(header.pl_size, "<i8", "pl_size")
    columns = [
        instance,
        _arr(header.pl_incarnation, "<u8", "pl_incarnation"),
        tier,
        backend,
        size,
        _arr(header.pl_shared, "u1", "pl_shared"),
        _arr(header.pl_access, "<f8", "pl_access"),
    ]
    n = len(instance)
    if any(len(c) != n for c in columns):
        raise SnapshotError("placement columns differ in length")
    if not n:
        return []
    strings = header.strings
    if (
        int(max(instance.max(), backend.max())) >= len(strings)
        or int(tier.max()) >= len(_TIERS)
        or int(size.min()) < 0
    ):
        raise SnapshotError("placement column out of range")
    table = np.empty(len(strings), dtype=object)
    table[:] = strings
    tiers = np.empty(len(_TIERS), dtype=object)
    tiers[:] = _TIERS
    return list(
        zip(
            table[instance].tolist(),
            columns[1].tolist(),
            tiers[tier].tolist(),
            table[backend].tolist(),
            size.tolist(),
            (columns[5] != 0).tolist(),
            columns[6].tolist(),
            strict=True,
        )
    )


def _build(
    header: _Header, cols: _Columns, tokens: list[Any]
) -> tuple[list[dict[bytes, Record]], dict[ShapeParts, int], list[KeyShape], list[bytes]]:
    """The partitions of records, the shape index and table, and every chunk's hash."""
    snap_to_sid, table, interned = _shapes(header)
    pls = _placements(header)
    raw = header.chunk_hashes
    n = len(cols.offsets)
    hashes: list[bytes] = np.frombuffer(raw, dtype="V32").tolist()  # exact 32-byte values
    # Column-wise: each chunk's first key, that key's first placement, its shape id.
    counts = cols.counts.astype(np.int64)
    kpc = cols.key_pl_counts.astype(np.int64)
    first_key = np.cumsum(counts) - counts
    first_ref = (np.cumsum(kpc) - kpc)[first_key]
    sids = np.asarray(snap_to_sid, dtype=np.int64)[cols.key_shapes]
    simple = (counts == 1) & (kpc[first_key] == 1)  # one key, one placement: most chunks
    records: list[Record] = list(
        zip(
            tokens,
            cols.offsets.tolist(),
            repeat(False, n),
            sids[first_key].tolist(),
            map(pls.__getitem__, cols.key_pls[first_ref].tolist()),
            strict=True,
        )
    )
    if not simple.all():
        ksh, kpl, kpc_list = sids.tolist(), cols.key_pls.tolist(), kpc.tolist()
        fk, fr = first_key.tolist(), np.cumsum(kpc) - kpc
        fr_list = fr.tolist()
        counts_list = cols.counts.tolist()
        for c in np.flatnonzero(~simple).tolist():
            flat: list[Any] = []
            for k in range(fk[c], fk[c] + counts_list[c]):
                npl, m = kpc_list[k], fr_list[k]
                group = pls[kpl[m]] if npl == 1 else tuple(pls[x] for x in kpl[m : m + npl])
                flat += (ksh[k], group)
            rec = records[c]
            records[c] = (rec[TOKENS], rec[OFFSET], False, *flat)
    parts: list[dict[bytes, Record]]
    first = np.frombuffer(raw, dtype=np.uint8)[::32]
    if n and bool((first[1:] >= first[:-1]).all()):  # as written: in partition order
        bounds = np.searchsorted(first, np.arange(PARTS + 1)).tolist()
        parts = [
            dict(
                zip(
                    hashes[bounds[p] : bounds[p + 1]],
                    records[bounds[p] : bounds[p + 1]],
                    strict=True,
                )
            )
            for p in range(PARTS)
        ]
    else:
        parts = [{} for _ in range(PARTS)]
        for h, rec in zip(hashes, records, strict=True):
            parts[h[0]][h] = rec
    if sum(len(p) for p in parts) != n:
        raise SnapshotError("duplicate chunk hashes in snapshot")
    return parts, interned, table, hashes


def _cursors(header: _Header) -> dict[str, EmitterCursor]:
    out = {}
    for name, inc, last_seq, gaps, missing, last in header.cursors:
        gap = None if last is None else GapRecord(*last)
        out[name] = EmitterCursor(inc, last_seq, gaps, missing, gap)
    return out


def _capacities(header: _Header) -> dict[str, CapacityDeclaration]:
    return {
        inst: CapacityDeclaration(inc, rev, {(t, b): n for t, b, n in caps})
        for inst, inc, rev, caps in header.capacities
    }


def _derived(header: _Header, cols: _Columns, hashes: list[bytes]) -> RestoredCounts:
    """Counters and L1 chunk sets computed column-wise (no pass over the records); the sets
    hold the same hash objects as the partitions."""
    strings = header.strings
    refs = cols.key_pls.astype(np.int64)
    tier = np.frombuffer(header.pl_tier, dtype="u1")[refs]
    size = np.frombuffer(header.pl_size, dtype="<i8")[refs]
    shared = np.frombuffer(header.pl_shared, dtype="u1")[refs]
    instance = np.frombuffer(header.pl_instance, dtype="<u4")[refs]
    chunk_of_key = np.repeat(np.arange(len(cols.counts)), cols.counts)
    chunk_of_ref = np.repeat(chunk_of_key, cols.key_pl_counts)
    by_tier: Counter[str] = Counter()
    for t, name in enumerate(_TIERS):
        mask = tier == t
        if mask.any():
            by_tier[name] = int(size[mask].sum())
    own_l1 = (tier == 0) & (shared == 0)
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
    return RestoredCounts(len(cols.key_shapes), len(refs), l1_counts, by_tier, l1_chunks)
