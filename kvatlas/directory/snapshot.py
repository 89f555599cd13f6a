"""Directory snapshots: durable, atomically written, quick to take and fast to restore.

Taking: copy-on-write by partition (see ``KeyDirectory._snapshot_part``). The directory lock
is held for one of 256 partitions at a time (≈1 ms at 1M keys), never for the whole
directory; changes made meanwhile save the snapshot-start state of what they touch first.
Serialisation and I/O run outside the lock.

Format: ``MAGIC | u64 header length | msgpack header | token arena``. The header is columnar
(numpy arrays as raw little-endian bytes, interned string/shape/placement tables) so restore is
a few vectorised checks plus one tight loop per chunk. Token ids follow as one arena; each
restored content gets its own read-only array (an arena view would pin the whole arena for as
long as any one chunk lives). The blend index is not stored: it is rebuilt from the bindings
when blend lookup is on. Written as temp file + fsync + rename + directory fsync, so a crash
leaves the previous snapshot intact.
"""

from __future__ import annotations

import gc
import os
import struct
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvatlas.directory.gate import EmitterCursor, GapRecord
from kvatlas.directory.key_directory import PARTS, DirectoryState, KeyDirectory, RestoredCounts
from kvatlas.directory.records import CapacityDeclaration, Chunk, KeyShape, Placement
from kvatlas.keys import BlendNamespace, ObjectKey

MAGIC = b"KVATSNP1"
VERSION = 1
_PREFIX = struct.Struct("<8sQ")
_TIERS = ("l1", "l2")


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
    shape_ids: dict[int, int] = {}
    shapes: list[tuple[int, int, int, int]] = []
    pl_ids: dict[int, int] = {}
    pls: list[Placement] = []
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
    try:
        for part_no in range(PARTS):
            rows, held = directory._snapshot_part(part_no)
            max_pause = max(max_pause, held)
            for h, tokens, offset, keys in rows:
                hashes.append(h)
                offsets.append(offset)
                if tokens is None:
                    token_lens.append(0)
                else:
                    token_lens.append(len(tokens))
                    arena.append(tokens)
                key_counts.append(len(keys) >> 1)
                for j in range(0, len(keys), 2):
                    shape: KeyShape = keys[j]
                    sid = shape_ids.get(id(shape))
                    if sid is None:
                        sid = shape_ids[id(shape)] = len(shapes)
                        shapes.append(
                            (
                                strings.ref(shape.model_name),
                                shape.kv_rank,
                                shape.object_group_id,
                                strings.ref(shape.cache_salt),
                            )
                        )
                    key_shapes.append(sid)
                    value = keys[j + 1]
                    group = (value,) if isinstance(value, Placement) else value
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
        pl_instance=_u32([strings.ref(p.instance_id) for p in pls]),
        pl_incarnation=np.array([p.incarnation for p in pls], dtype="<u8").tobytes(),
        pl_tier=np.array([_TIERS.index(p.tier) for p in pls], dtype="u1").tobytes(),
        pl_backend=_u32([strings.ref(p.backend) for p in pls]),
        pl_size=np.array([p.size_bytes for p in pls], dtype="<i8").tobytes(),
        pl_shared=np.array([p.shared for p in pls], dtype="u1").tobytes(),
        pl_access=np.array([p.last_access for p in pls], dtype="<f8").tobytes(),
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


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Millions of new container objects would trigger repeated full collections."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_snapshot(directory: KeyDirectory, path: str | os.PathLike[str]) -> SnapshotInfo:
    """Replace ``directory``'s state with the snapshot at ``path``; rebuild the blend index
    from the restored bindings if blend lookup is on. Raises :class:`SnapshotError`."""
    started = time.perf_counter()
    data = Path(path).read_bytes()
    if len(data) < _PREFIX.size:
        raise SnapshotError("file too short for a snapshot")
    magic, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("not a kvatlas snapshot (bad magic)")
    body = _PREFIX.size + header_len
    if body > len(data):
        raise SnapshotError("truncated snapshot header")
    try:
        header = msgspec.msgpack.decode(data[_PREFIX.size : body], type=_Header)
    except msgspec.MsgspecError as exc:
        raise SnapshotError(f"corrupt snapshot header: {exc}") from None
    if header.version != VERSION:
        raise SnapshotError(f"unsupported snapshot version {header.version}")
    if len(data) - body != 4 * header.arena_tokens:
        raise SnapshotError("token arena length does not match the header")
    arena = np.frombuffer(data, dtype="<u4", offset=body, count=header.arena_tokens)
    with _gc_paused():
        parts, shapes, n_keys = _build(header, arena)
        state = DirectoryState(header.chunk_size, _cursors(header), _capacities(header))
        directory._install(parts, shapes, state, _derived(header))
    return SnapshotInfo(
        str(path),
        sum(len(p) for p in parts),
        n_keys,
        len(data),
        time.perf_counter() - started,
        0.0,
        header.stream_position,
    )


def _shapes(header: _Header) -> tuple[list[KeyShape], dict[tuple[str, int, int, str], KeyShape]]:
    strings = header.strings
    out: list[KeyShape] = []
    interned: dict[tuple[str, int, int, str], KeyShape] = {}
    try:
        for model_ref, kv_rank, group, salt_ref in header.shapes:
            key = ObjectKey(bytes(32), strings[model_ref], kv_rank, group, strings[salt_ref])
            parts = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
            ns = BlendNamespace(key.model_name, key.cache_salt, key.world_size)
            shape = interned.setdefault(parts, KeyShape(*parts, ns))
            out.append(shape)
    except (ValueError, IndexError) as exc:
        raise SnapshotError(f"invalid key shape in snapshot: {exc}") from None
    return out, interned


def _placements(header: _Header) -> list[Placement]:
    instance = _arr(header.pl_instance, "<u4", "pl_instance")
    columns = [
        instance,
        _arr(header.pl_incarnation, "<u8", "pl_incarnation"),
        _arr(header.pl_tier, "u1", "pl_tier"),
        _arr(header.pl_backend, "<u4", "pl_backend"),
        _arr(header.pl_size, "<i8", "pl_size"),
        _arr(header.pl_shared, "u1", "pl_shared"),
        _arr(header.pl_access, "<f8", "pl_access"),
    ]
    n = len(instance)
    if any(len(c) != n for c in columns):
        raise SnapshotError("placement columns differ in length")
    strings = header.strings
    if n and (
        int(max(columns[0].max(), columns[3].max())) >= len(strings)
        or int(columns[2].max()) >= len(_TIERS)
        or int(columns[4].min()) < 0
    ):
        raise SnapshotError("placement column out of range")
    return [
        Placement(strings[i], inc, _TIERS[t], strings[b], size, bool(sh), acc)
        for i, inc, t, b, size, sh, acc in zip(*(c.tolist() for c in columns), strict=True)
    ]


def _build(
    header: _Header, arena: np.ndarray[Any, Any]
) -> tuple[list[dict[bytes, Chunk]], dict[tuple[str, int, int, str], KeyShape], int]:
    shapes, interned = _shapes(header)
    pls = _placements(header)
    raw_hashes = header.chunk_hashes
    offsets = _arr(header.chunk_offsets, "<i8", "chunk_offsets")
    lens = _arr(header.chunk_token_lens, "<u4", "chunk_token_lens")
    counts = _arr(header.chunk_key_counts, "<u4", "chunk_key_counts")
    key_shapes = _arr(header.key_shapes, "<u4", "key_shapes")
    key_pl_counts = _arr(header.key_pl_counts, "<u4", "key_pl_counts")
    key_pls = _arr(header.key_pls, "<u4", "key_pls")
    n = len(offsets)
    if (
        len(raw_hashes) != 32 * n
        or len(lens) != n
        or len(counts) != n
        or int(counts.sum()) != len(key_shapes)
        or len(key_pl_counts) != len(key_shapes)
        or int(key_pl_counts.sum()) != len(key_pls)
        or int(lens.sum(dtype=np.int64)) != len(arena)
        or (n and (int(offsets.min()) < -1 or int(counts.min()) < 1))
        or (len(key_shapes) and int(key_shapes.max()) >= len(shapes))
        or (len(key_pl_counts) and int(key_pl_counts.min()) < 1)
        or (len(key_pls) and int(key_pls.max()) >= len(pls))
    ):
        raise SnapshotError("inconsistent snapshot columns")
    parts: list[dict[bytes, Chunk]] = [{} for _ in range(PARTS)]
    ends = np.cumsum(lens, dtype=np.int64).tolist()
    ksh, kpc, kpl = key_shapes.tolist(), key_pl_counts.tolist(), key_pls.tolist()
    k = m = 0
    begin = 0
    for c, (offset, length, nk) in enumerate(
        zip(offsets.tolist(), lens.tolist(), counts.tolist(), strict=True)
    ):
        h = raw_hashes[32 * c : 32 * c + 32]
        tokens = None
        if length:
            end = ends[c]
            tokens = arena[begin:end].astype(np.uint32)  # a private copy, see module doc
            tokens.flags.writeable = False
            begin = end
        if nk == 1 and kpc[k] == 1:
            keys: tuple[Any, ...] = (shapes[ksh[k]], pls[kpl[m]])
            k += 1
            m += 1
        else:
            flat: list[Any] = []
            for _ in range(nk):
                npl = kpc[k]
                group = pls[kpl[m]] if npl == 1 else tuple(pls[x] for x in kpl[m : m + npl])
                flat += (shapes[ksh[k]], group)
                k += 1
                m += npl
            keys = tuple(flat)
        parts[h[0]][h] = Chunk(tokens, offset, keys)
    if sum(len(p) for p in parts) != n:
        raise SnapshotError("duplicate chunk hashes in snapshot")
    return parts, interned, len(ksh)


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


def _derived(header: _Header) -> RestoredCounts:
    """Counters and L1 chunk sets computed column-wise (no pass over the chunk objects)."""
    strings = header.strings
    refs = np.frombuffer(header.key_pls, dtype="<u4").astype(np.int64)
    pl_counts = np.frombuffer(header.key_pl_counts, dtype="<u4")
    key_counts = np.frombuffer(header.chunk_key_counts, dtype="<u4")
    tier = np.frombuffer(header.pl_tier, dtype="u1")[refs]
    size = np.frombuffer(header.pl_size, dtype="<i8")[refs]
    shared = np.frombuffer(header.pl_shared, dtype="u1")[refs]
    instance = np.frombuffer(header.pl_instance, dtype="<u4")[refs]
    chunk_of_key = np.repeat(np.arange(len(key_counts)), key_counts)
    chunk_of_ref = np.repeat(chunk_of_key, pl_counts)
    by_tier: Counter[str] = Counter()
    for t, name in enumerate(_TIERS):
        mask = tier == t
        if mask.any():
            by_tier[name] = int(size[mask].sum())
    own_l1 = (tier == 0) & (shared == 0)
    l1_counts: Counter[str] = Counter()
    l1_chunks: dict[str, set[bytes]] = {}
    raw = header.chunk_hashes
    for inst in np.unique(instance[own_l1]).tolist():
        mask = own_l1 & (instance == inst)
        l1_counts[strings[inst]] = int(mask.sum())
        chunks = np.unique(chunk_of_ref[mask]).tolist()
        l1_chunks[strings[inst]] = {raw[32 * c : 32 * c + 32] for c in chunks}
    return RestoredCounts(len(pl_counts), len(refs), l1_counts, by_tier, l1_chunks)
