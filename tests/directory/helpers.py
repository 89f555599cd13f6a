"""Small builders shared by the directory tests."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvatlas.directory import KeyDirectory
from kvatlas.directory.blend.kernels.layout import IDS_FREE_OCCUPANT, IDS_OCCUPANTS, O_HASH, O_NEXT
from kvatlas.directory.blend.state import IndexState
from kvatlas.directory.chunk_parts import ChunkColumns, ChunkPart, l1_chunks
from kvatlas.directory.records import Record, l1_owner, placement_groups, placements_of
from kvatlas.directory.snapshot.format import PREFIX, Header
from kvatlas.directory.snapshot.integrity import PieceDigests
from kvatlas.directory.token_store import form_sizes
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank

CS = 4  # chunk size used by the directory tests


def records_built(monkeypatch: Any) -> list[int]:
    """The rows whose record is built from now on (``ChunkColumns.record`` counted) until
    ``monkeypatch.undo()``: what a path by columns must not build."""
    built: list[int] = []
    record = ChunkColumns.record

    def counted(self: ChunkColumns, r: int) -> Any:
        built.append(r)
        return record(self, r)

    monkeypatch.setattr(ChunkColumns, "record", counted)
    return built


def key(n: int, model: str = "m", salt: str = "", ws: int = 1, rank: int = 0) -> ObjectKey:
    return ObjectKey(bytes([n]) * 32, model, pack_kv_rank(ws, rank, ws, rank), 0, salt)


def toks(*values: int) -> np.ndarray[Any, Any]:
    return np.array(values, dtype=np.uint32)


def entry(k: ObjectKey, tokens: Any = None, offset: int = -1, size: int = 10) -> CacheEntry:
    return CacheEntry(k, size, tokens, offset)


class Emitter:
    """Numbers batches like a real emitter: (incarnation, seq) with seq += 1 per batch."""

    def __init__(self, instance_id: str = "a", incarnation: int = 1) -> None:
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.seq = 0

    def batch(
        self,
        kind: str,
        entries: list[CacheEntry] | tuple[CacheEntry, ...] = (),
        tier: str = "l1",
        backend: str = "dram",
        shared: bool = False,
        ts: float = 0.0,
        **kw: Any,
    ) -> EventBatch:
        self.seq += 1
        return EventBatch(
            self.instance_id,
            self.incarnation,
            self.seq,
            kind,
            tier,
            backend,
            shared,
            ts,
            tuple(entries),
            **kw,
        )

    def restart(self) -> None:
        self.incarnation += 1
        self.seq = 0


def captured(d: KeyDirectory) -> dict[bytes, Record]:
    """Every chunk's record, through a capture (records are immutable: the live ones)."""
    with d.capture() as capture:
        return {h: rec for part in capture.parts() for h, rec in part.records()}


def live_records(d: KeyDirectory) -> dict[bytes, Record]:
    """Every chunk's record, read from the partitions directly: :func:`captured`'s records
    (the same ones, in the same order) without a capture, whose 256 partitions, each taken and
    finished under the lock, cost ≈6 ms a call: the property tests that compare a directory's
    state after every step (``test_fence_columns.state``, ``test_l1_owners.check``) spent most
    of their time there. Tests of the capture itself read through :func:`captured`."""
    return {h: rec for part in d._chunks.parts for h, rec in part.items()}


def l1_chunk_sets(d: KeyDirectory) -> dict[str, set[bytes]]:
    """Per instance, the chunks the table's L1 owner column says hold an own L1 copy of it
    (what fencing visits; instances without any left out)."""
    parts = d._chunks.parts
    names = parts[0].cols.l1.names
    return {n: hs for n in names if (hs := set(l1_chunks(parts, n)))}


def l1_chunk_model(parts: list[ChunkPart] | dict[bytes, Record]) -> dict[str, set[bytes]]:
    """The same, brute force: a pass over every record's placements."""
    records = parts.items() if isinstance(parts, dict) else (x for p in parts for x in p.items())
    out: dict[str, set[bytes]] = {}
    for h, rec in records:
        for pls in placement_groups(rec):
            for p in placements_of(pls):
                owner = l1_owner(p)
                if owner is not None:
                    out.setdefault(owner, set()).add(h)
    return out


def change_later(index: Any, tokens: Any, chunk_hash: bytes, offset: int, ns: Any) -> None:
    """A later change of the index property tests, chosen by ``offset % 3``: remove the
    claim, remove the chunk, or add it (a blend index, or an oracle with the same methods)."""
    if offset % 3 == 0:
        index.remove_claim(tokens, chunk_hash, ns)
    elif offset % 3 == 1:
        index.remove_chunk(tokens, chunk_hash)
    else:
        index.add(tokens, chunk_hash, offset, ns)


def occupant_hashes(state: IndexState) -> list[bytes | None]:
    """Each occupant id's chunk_hash as a blend index's state holds it (by value, in its
    ``o_i64`` row), ``None`` for a free id (one on the free list): what the state kept as a
    list of the writers' ``bytes`` before it kept them as a column."""
    arrays = state.arrays
    free, o = set(), int(arrays.ids[IDS_FREE_OCCUPANT])
    while o != -1:
        free.add(o)
        o = int(arrays.o_i32[o, O_NEXT])
    rows, lengths = arrays.o_i64[:, O_HASH:], arrays.o_hlen.tolist()
    n = int(arrays.ids[IDS_OCCUPANTS])
    return [None if o in free else rows[o].tobytes()[: lengths[o]] for o in range(n)]


def sealed(raw: bytes) -> bytes:
    """``raw``, a version-6 snapshot whose header or token section a test edited (as a writer
    of the file could), with its checksums made again for the bytes it now holds (its old
    trailer, if any, replaced): the checks behind the checksums are what such a test tests."""
    _, n = PREFIX.unpack_from(raw)
    header = msgspec.msgpack.decode(raw[PREFIX.size : PREFIX.size + n], type=Header[bytes])
    lens = np.frombuffer(header.chunk_token_lens, "<u4")
    forms = np.frombuffer(header.chunk_token_widths, np.uint8).astype(np.int64)
    sizes = form_sizes(lens, forms)
    body = PREFIX.size + n
    end = body + int(sizes.sum())
    digests = PieceDigests([sizes], header.checksum_piece)
    digests.header(raw[:body])
    digests.arena(raw[body:end])
    return raw[:end] + digests.trailer()
