"""Writing snapshots: consistent, atomic, and with the directory lock held one partition at a time.

The snapshot is the directory as it was when :func:`save_snapshot` started its capture (see
:mod:`kvatlas.directory.capture`); serialisation and I/O run outside the directory lock. The
file is written as temp file + fsync + rename + directory fsync, so a crash leaves the previous
snapshot intact. It is created mode 0600 (it holds every tenant's token ids; docs/security.md).
The blend index is not stored (a restore rebuilds it from the bindings), but with blend on
each content's fingerprint is, under the index's key (``blend/fingerprints.py``), so the
rebuild need not read and hash every id.

Ingestion goes on while a snapshot is written, on other threads that need the GIL: no single
call here converts, copies, sums or frees a whole column at once (:data:`_SLICE` items at a
time), and the header's large byte columns are written from where they are instead of being
copied into one msgpack buffer (:class:`HeaderPieces`), so a concurrent client waits for a
slice, not for a column of a million keys. Freeing counts too: dropping a list of a million
references to objects spread over the heap holds the GIL for one long call, so the columns
are emptied a slice at a time (:meth:`_Columns.release`) before the function returns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_not
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvatlas.directory.blend.fingerprints import ContentReads
from kvatlas.directory.capture import CapturedPart, DirectoryState
from kvatlas.directory.key_directory import KeyDirectory
from kvatlas.directory.records import (
    PlacementRow,
    placements_of,
    row_backend,
    row_incarnation,
    row_instance,
    row_last_access,
    row_shared,
    row_size,
    row_tier,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.snapshot.format import (
    MAGIC,
    PREFIX,
    TIERS,
    VERSION,
    Header,
    InstanceRow,
    SnapshotInfo,
    cursor_row,
    encode_column,
    tenant_rows,
)
from kvatlas.directory.snapshot.integrity import PieceDigests
from kvatlas.directory.token_store import StoredTokens, form_sizes, stored_payload, stored_shapes
from kvatlas.durable import fsync_directory

_SLICE = 1 << 13  # items per GIL-holding conversion, copy or release: bounds the longest hold


_CHUNK_COLUMNS = (
    "chunk_hashes",
    "chunk_offsets",
    "chunk_token_lens",
    "chunk_token_widths",
    "chunk_key_counts",
    "key_shapes",
    "key_pl_counts",
    "key_pls",
)
_LARGE = 1 << 16  # byte fields longer than this are written in place (msgpack bin32)
_MARKER_BYTES = 16


def _column_slices(name: str, values: Sequence[Any] | np.ndarray[Any, Any]) -> list[bytes]:
    """``encode_column`` a slice at a time: the same bytes, in calls that each hold the GIL
    briefly."""
    return [encode_column(name, values[i : i + _SLICE]) for i in range(0, len(values), _SLICE)]


def _join_slices(parts: list[bytes]) -> list[bytes]:
    """``b"".join(parts)`` a slice at a time."""
    return [b"".join(parts[i : i + _SLICE]) for i in range(0, len(parts), _SLICE)]


def _release(values: list[Any] | dict[Any, Any]) -> None:
    """Empty ``values`` a slice at a time (the GIL can change hands between slices)."""
    if isinstance(values, dict):
        while values:
            for _ in range(min(_SLICE, len(values))):
                values.popitem()
        return
    while values:
        del values[-_SLICE:]


def _bin_head(size: int) -> bytes:
    """msgpack's head of a ``size``-byte bin (the smallest form, as every encoder writes)."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


class HeaderPieces:
    """The header's large byte fields kept as pieces: :meth:`field` stands in a unique 16-byte
    marker for a large field; :meth:`encode` encodes the header and puts each field's pieces
    where its marker's ``bin8`` was, behind the field's own bin head. The pieces concatenate to exactly
    ``msgspec.msgpack.encode`` of the header with the fields joined (tests), but no call copies
    every column into one buffer while holding the GIL, and the file is written piece by piece
    (the GIL released during each write)."""

    def __init__(self) -> None:
        self.fields: dict[bytes, list[bytes]] = {}

    def field(self, pieces: list[bytes]) -> bytes:
        if sum(map(len, pieces)) <= _LARGE:
            return b"".join(pieces)
        marker = os.urandom(_MARKER_BYTES)
        self.fields[marker] = pieces
        return marker

    def encode(self, header: Header[bytes]) -> list[bytes]:
        encoded = msgspec.msgpack.encode(header)
        found = []
        for marker, pieces in self.fields.items():
            tagged = b"\xc4" + bytes([_MARKER_BYTES]) + marker  # bin8 of the marker
            at = encoded.find(tagged)
            if at < 0 or encoded.find(tagged, at + 1) >= 0:  # not unique: ~2^-128
                return [msgspec.msgpack.encode(self.joined(header))]
            found.append((at, len(tagged), pieces))
        out, pos = [], 0
        for at, length, pieces in sorted(found, key=lambda f: f[0]):
            out += [encoded[pos:at], _bin_head(sum(map(len, pieces)))]
            out += pieces
            pos = at + length
        out.append(encoded[pos:])
        return out

    def joined(self, header: Header[bytes]) -> Header[bytes]:
        """``header`` with every marker replaced by its field's bytes."""
        fields = {
            name: b"".join(self.fields[value])
            for name in header.__struct_fields__
            if isinstance(value := getattr(header, name), bytes) and value in self.fields
        }
        return msgspec.structs.replace(header, **fields)


def save_snapshot(
    directory: KeyDirectory,
    path: str | os.PathLike[str],
    *,
    stream_position: str | None = None,
    instances: list[InstanceRow] | None = None,
    sections: dict[str, bytes] | None = None,
) -> SnapshotInfo:
    """Write a consistent snapshot of ``directory`` (and the coordinator's instance registry
    and ``sections``, if given) to ``path`` (atomically)."""
    started = time.perf_counter()
    max_pause = 0.0
    columns: _Columns | None = None
    try:
        with directory.capture() as capture:
            columns = _Columns(capture.shapes, capture.state)
            for part in capture.parts():
                max_pause = max(max_pause, part.lock_held_s)
                columns.add(part)
        chunks, keys = columns.chunks, columns.keys
        header = columns.header(capture.state, stream_position)
        header.instances = instances
        header.sections = sections
        digests = PieceDigests(columns.sizes)
        header.checksum_piece = digests.piece
        pieces = columns.pieces.encode(header)
        size = _write_atomically(Path(path), pieces, columns.arena, digests)
    finally:
        if columns is not None:
            columns.release()
    return SnapshotInfo(
        str(path),
        chunks,
        keys,
        size,
        time.perf_counter() - started,
        max_pause,
        stream_position,
        instances,
        sections,
    )


class _Columns:
    """The header's tables and columns, accumulated a partition at a time: each partition's
    share of a column is encoded when it is added (:data:`_CHUNK_COLUMNS`: a list of
    ``bytes`` pieces per column), its contents kept in an object array per partition. No
    container the cyclic collector tracks holds a reference per chunk: a young collection
    while the snapshot is written does not traverse every chunk so far, holding the GIL
    (docs/performance.md, "Directory: design figures")."""

    def __init__(self, shapes: ShapeTable, state: DirectoryState) -> None:
        self.table = shapes
        self.key = state.fingerprint_key
        self.anchor_key = state.anchor_key
        self.fingerprints: list[np.ndarray[Any, Any]] = []  # a piece per partition
        self.anchors: list[np.ndarray[Any, Any]] = []  # the same
        self.strings: list[str] = []
        self.string_ids: dict[str, int] = {}
        self.shape_ids: dict[int, int] = {}  # directory shape id -> snapshot shape id
        self.shapes: list[tuple[int, int, int, int]] = []
        self.pl_ids: dict[int, int] = {}  # id(row) -> snapshot placement id
        self.pls: list[PlacementRow] = []
        self.encoded: dict[str, list[bytes]] = {name: [] for name in _CHUNK_COLUMNS}
        self.arena: list[np.ndarray[Any, Any]] = []  # each partition's contents
        self.sizes: list[np.ndarray[Any, Any]] = []  # each partition's chunks' arena bytes
        self.arena_tokens = 0
        self.chunks = self.keys = 0
        self.pieces = HeaderPieces()

    def column(self, name: str, values: list[Any]) -> bytes:
        return self.pieces.field(_column_slices(name, values))

    def encoded_field(self, name: str) -> bytes:
        """Column ``name`` of the chunks, from the pieces :meth:`add` encoded."""
        return self.pieces.field(self.encoded[name])

    def ref(self, s: str) -> int:
        i = self.string_ids.get(s)
        if i is None:
            i = self.string_ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def add(self, part: CapturedPart) -> None:
        lens, widths = self._add_contents(part.tokens)
        key_counts, key_shapes, pl_counts, key_pls = self._add_keys(part)
        encoded = self.encoded
        encoded["chunk_hashes"] += _join_slices(part.hashes)
        for name, values in (
            ("chunk_offsets", part.offsets),
            ("chunk_token_lens", lens),
            ("chunk_token_widths", widths),
            ("chunk_key_counts", key_counts),
            ("key_shapes", key_shapes),
            ("key_pl_counts", pl_counts),
            ("key_pls", key_pls),
        ):
            encoded[name] += _column_slices(name, values)
        self.chunks += len(part.hashes)
        self.keys += len(key_shapes)

    def _add_contents(
        self, tokens: Sequence[StoredTokens | None]
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Keeps a partition's contents (and their fingerprints and anchors, blend on);
        returns each chunk's count of ids and form (0 and 4 without a content)."""
        n = len(tokens)
        has = np.fromiter(map(is_not, tokens, repeat(None)), np.bool_, n)
        bound: list[StoredTokens] = list(compress(tokens, has.tolist()))  # type: ignore[arg-type]
        counts, forms = stored_shapes(bound)  # ids and form of each (one compiled pass)
        lens, widths = np.zeros(n, np.int64), np.full(n, 4, np.int64)
        lens[has], widths[has] = counts, forms
        self.sizes.append(form_sizes(lens, widths))
        self.arena_tokens += int(counts.sum())
        contents = np.empty(len(bound), object)  # numpy arrays are not containers to the
        contents[:] = bound  # cyclic collector: no collection traverses a partition's contents
        self.arena.append(contents)
        keyed = [
            (key, pieces)
            for key, pieces in ((self.key, self.fingerprints), (self.anchor_key, self.anchors))
            if key is not None
        ]
        if keyed:  # (both keys are the index's: one chunk size)
            full = np.flatnonzero(counts == keyed[0][0].chunk_size)
            at = np.flatnonzero(has)[full]
            reads = ContentReads.of([bound[i] for i in full.tolist()])  # (once for both)
            for key, pieces in keyed:
                values = np.zeros(n, np.uint64)  # 0: no content of chunk_size ids
                values[at] = key.of_reads(reads)
                pieces.append(values)
        return lens, widths

    def _add_keys(self, part: CapturedPart) -> tuple[list[int], ...]:
        """A partition's keys: each chunk's count of keys, each key's shape, count of
        placements and placement ids (a shape or placement row seen first is added to the
        tables)."""
        key_counts: list[int] = []
        key_shapes: list[int] = []
        pl_counts: list[int] = []
        key_pls: list[int] = []
        shape_ids, pl_ids, pls = self.shape_ids, self.pl_ids, self.pls
        for flagged, first, rest in zip(part.flagged, part.placements, part.rests, strict=True):
            keys = ((flagged >> 1, first), *zip(rest[0::2], rest[1::2], strict=True))
            key_counts.append(len(keys))
            for sid, group in keys:
                ref = shape_ids.get(sid)
                if ref is None:
                    shape = self.table[sid]
                    ref = shape_ids[sid] = len(self.shapes)
                    model, salt = self.ref(shape.model_name), self.ref(shape.cache_salt)
                    self.shapes.append((model, shape.kv_rank, shape.object_group_id, salt))
                key_shapes.append(ref)
                rows = placements_of(group)
                pl_counts.append(len(rows))
                for p in rows:  # rows are shared (one per batch and size): store each once
                    pid = pl_ids.get(id(p))
                    if pid is None:
                        pid = pl_ids[id(p)] = len(pls)
                        pls.append(p)
                    key_pls.append(pid)
        return key_counts, key_shapes, pl_counts, key_pls

    def release(self) -> None:
        """Drop every column a slice at a time (see the module docstring)."""
        while self.arena:  # a partition's contents at a time (an array drops each reference)
            self.arena.pop()
        self.sizes.clear()
        for values in (self.pls, self.pl_ids, self.fingerprints, self.anchors):
            _release(values)
        self.encoded.clear()
        self.pieces.fields.clear()

    def header(self, state: DirectoryState, stream_position: str | None) -> Header[bytes]:
        pls = self.pls
        key, fps = self.key, [a.tobytes() for a in self.fingerprints]
        anchor_key, anchors = self.anchor_key, [a.tobytes() for a in self.anchors]
        instances = [self.ref(row_instance(p)) for p in pls]  # before backends: string order
        backends = [self.ref(row_backend(p)) for p in pls]
        return Header(
            version=VERSION,
            chunk_size=state.chunk_size,
            stream_position=stream_position,
            strings=self.strings,
            shapes=self.shapes,
            pl_instance=self.column("pl_instance", instances),
            pl_incarnation=self.column("pl_incarnation", [row_incarnation(p) for p in pls]),
            pl_tier=self.column("pl_tier", [TIERS.index(row_tier(p)) for p in pls]),
            pl_backend=self.column("pl_backend", backends),
            pl_size=self.column("pl_size", [row_size(p) for p in pls]),
            pl_shared=self.column("pl_shared", [row_shared(p) for p in pls]),
            pl_access=self.column("pl_access", [row_last_access(p) for p in pls]),
            chunk_hashes=self.encoded_field("chunk_hashes"),
            chunk_offsets=self.encoded_field("chunk_offsets"),
            chunk_token_lens=self.encoded_field("chunk_token_lens"),
            chunk_key_counts=self.encoded_field("chunk_key_counts"),
            key_shapes=self.encoded_field("key_shapes"),
            key_pl_counts=self.encoded_field("key_pl_counts"),
            key_pls=self.encoded_field("key_pls"),
            cursors=[cursor_row(name, c) for name, c in state.cursors.items()],
            capacities=[
                (inst, d.incarnation, d.revision, [(t, b, n) for (t, b), n in d.capacities.items()])
                for inst, d in state.capacities.items()
            ],
            arena_tokens=self.arena_tokens,
            chunk_token_widths=self.encoded_field("chunk_token_widths"),
            chunk_fingerprints=self.pieces.field(fps) if key is not None else b"",
            fingerprint_key=None if key is None else (key.scheme, key.bits, key.base),
            fingerprint_digest=b"" if key is None else key.digest(fps),
            chunk_anchors=self.pieces.field(anchors) if anchor_key is not None else b"",
            anchor_key=None if anchor_key is None else (anchor_key.scheme, list(anchor_key.keys)),
            anchor_digest=b"" if anchor_key is None else anchor_key.digest(anchors),
            tenant_bindings=tenant_rows(state.tenants),
        )


_ARENA_BLOCK = 256  # token arrays per write (256 chunks of 256 tokens: at most 256 KiB)


def _temp_prefix(path: Path) -> str:
    """How the name of a snapshot of ``path`` begins until it is complete: the writer's pid
    and a time in ns follow (``.<name>.tmp-<pid>-<ns>``)."""
    return f".{path.name}.tmp-"


def remove_stale_temps(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Remove the temporary files of ``path``'s snapshots that a process killed while writing
    one left (``.<name>.tmp-<pid>-<ns>`` beside it: each up to a snapshot's size, and every
    tenant's token ids) — not one whose process still runs, but this process's own (a restart
    may be given its predecessor's pid). Returns (files, bytes) removed."""
    path = Path(path)
    prefix = _temp_prefix(path)
    files = size = 0
    try:
        found = [p for p in path.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return 0, 0
    for tmp in found:
        pid, _, ns = tmp.name[len(prefix) :].partition("-")
        if not (pid.isdigit() and ns.isdigit()) or (int(pid) != os.getpid() and _alive(int(pid))):
            continue
        try:
            n = tmp.stat().st_size
            tmp.unlink()
        except OSError:
            continue
        files, size = files + 1, size + n
    return files, size


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: alive)
        return True
    return True


def _write_atomically(
    path: Path, header: list[bytes], arena: list[np.ndarray[Any, Any]], digests: PieceDigests
) -> int:
    tmp = path.with_name(f"{_temp_prefix(path)}{os.getpid()}-{time.monotonic_ns()}")
    try:
        # 0600 from creation on: the file holds every tenant's token ids (docs/security.md)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            prefix = PREFIX.pack(MAGIC, sum(map(len, header)))
            f.write(prefix)
            digests.header(prefix)
            for piece in header:
                f.write(piece)  # a large piece is written without a copy, the GIL released
                digests.header(piece)
            for contents in arena:  # a partition's
                for start in range(0, len(contents), _ARENA_BLOCK):
                    block = contents[start : start + _ARENA_BLOCK]
                    # each content's ids in its stored form; the write drops the GIL
                    data = b"".join(list(map(stored_payload, block)))
                    f.write(data)
                    digests.arena(data)
            f.write(digests.trailer())  # (version 6: the checksums, integrity.py)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return size
