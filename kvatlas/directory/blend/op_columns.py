"""A batch of index writes as validated columns: what :meth:`IndexState.apply` takes.

:func:`op_columns` turns the typed ops of :meth:`BlendIndex.apply` into one
:class:`OpColumns`. Single ops are validated one by one (tokens checked and copied unless the
index may keep the caller's array, hashes and offsets checked; a content that is not
``chunk_size`` tokens long is skipped, an add of one logged). An :class:`AddColumns` whose
every column is already in the form the index keeps (the directory's stored arrays, exact
hashes, valid offsets) is taken as it is, with C-level checks over whole columns and no Python
per entry; any other is validated as the ``AddOp``s it stands for, so both give the same
state and the same errors. A :class:`RemoveClaimColumns` the directory vouches for is taken
as it is; any other as the ``RemoveClaimOp``s it stands for.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import _cpython
from kvatlas.directory.blend.kernels import ADD, REMOVE_CHUNK, REMOVE_CLAIM
from kvatlas.directory.blend.kernels.contents import (
    content_count,
    token_addresses,
    vouched_layout,
)
from kvatlas.directory.blend.kernels.objects import (
    C_CONTIGUOUS,
    OWNDATA,
    WRITEABLE,
    object_handles,
)
from kvatlas.directory.blend.kernels.planes import PLANES, planes_count
from kvatlas.directory.blend.op_checks import (
    HASH_WIDTH,
    U16,
    U32,
    Tokens,
    byte_lengths,
    checked_objects,
    filled,
    token_width,
    token_widths,
)
from kvatlas.directory.blend.ops import (
    AddColumns,
    AddOp,
    BlendOp,
    RemoveChunkOp,
    RemoveClaimColumns,
    RemoveClaimOp,
)
from kvatlas.keys import BlendNamespace, as_token_array

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class OpColumns:
    """Op ``i``: ``kinds[i]`` of content ``tokens[i]`` (``chunk_size`` ids at address
    ``addrs[i]``, ``token_bytes[i]`` bytes each, 1: the planes form; ``owned[i]``: the index's
    own copy; ``contents``: every one a ``bytes`` content; ``id_bytes``: the bytes of all their
    ids, headers not counted, when read already) and chunk hash ``hashes[i]`` (exact
    ``bytes``, ``hash_lens[i]`` <= 32 long), offset ``offsets[i]`` (>= 0; 0 unless an add), namespace
    ``spaces[space_of[i]]`` (-1: none, a remove_chunk)."""

    kinds: npt.NDArray[np.int64]
    tokens: list[Tokens]
    hashes: list[bytes]
    hash_lens: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    token_bytes: npt.NDArray[np.int64]
    spaces: list[BlendNamespace]
    space_of: npt.NDArray[np.int64]
    owned: npt.NDArray[np.bool_]
    addrs: npt.NDArray[np.int64]
    contents: bool
    id_bytes: int | None = None

    def __len__(self) -> int:
        return len(self.hashes)


SingleOp = tuple[int, Tokens, bytes, int, BlendNamespace | None, bool]
"""One validated write, what an :class:`OpColumns` holds per op: ``(kind, tokens, chunk_hash,
offset, namespace, owned)`` (``namespace`` ``None``: a remove_chunk). A plain tuple: a named
one costs more to make than the rest of a single write's validation."""


def single_op(
    kind: int,
    tokens: Any,
    chunk_hash: Any,
    offset: Any,
    namespace: BlendNamespace | None,
    chunk: int,
) -> SingleOp | None:
    """The write ``kind`` with these arguments, validated (``offset`` is an add's; ``namespace``
    ``None`` for a remove_chunk); ``None`` when content not ``chunk`` tokens long makes it a
    no-op. Raises ``ValueError`` when an argument is invalid."""
    if kind == ADD:
        if type(offset) is not int or not 0 <= offset < 1 << 63:
            offset = _offset(offset)
    else:
        offset = 0
    count = -1
    arr: Any
    if type(tokens) is bytes:
        arr, size = tokens, len(tokens)
        sizes = _SIZES.get(chunk) or _sizes(chunk)
        if size < 2 or sizes.get(tokens[0] << 8 | tokens[1]) != size:
            count = content_count(tokens)  # (a malformed one: ValueError)
        else:
            count = chunk
    elif type(tokens) is np.ndarray and tokens.ndim == 1:
        if tokens.dtype is U16 or tokens.dtype is U32:
            arr = tokens  # the directory's arrays: no re-validation
        elif tokens.dtype is PLANES:
            arr, count = tokens, planes_count(tokens)  # (a malformed one: ValueError)
        else:
            arr = as_token_array(tokens)
    else:
        arr = as_token_array(tokens)
    if (len(arr) if count < 0 else count) != chunk:  # arr is 1-D
        if kind == ADD:
            n = len(arr) if count < 0 else count
            log.info("blend index: not indexing %d-token content (chunk_size %d)", n, chunk)
        return None
    if type(chunk_hash) is not bytes or len(chunk_hash) > HASH_WIDTH:
        chunk_hash = _hash_bytes(chunk_hash)
    own = False
    if type(arr) is bytes:
        pass  # immutable, and exactly the content: kept as it is
    elif kind == ADD:
        own = not _shareable(arr)
        if own:
            arr = np.array(arr, dtype=arr.dtype, order="C", copy=True)
            arr.setflags(write=False)
    elif not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return kind, arr, chunk_hash, offset, namespace, own


_SIZES: dict[int, dict[int, int]] = {}
"""Per chunk size, :func:`_sizes`."""


def _sizes(chunk: int) -> dict[int, int]:
    """The byte length of a content of ``chunk`` ids under each header (its first two bytes,
    ``b0 << 8 | b1``), each one checked by ``content_count`` here: a content of that header
    and length is well formed and holds ``chunk`` ids (the common single write's check, one
    lookup; any other goes through ``content_count``)."""
    forms = {2: 2 + 2 * chunk, 4: 4 + 4 * chunk}  # uint16, uint32
    forms |= {h << 8: 2 + 2 * chunk + 2 * h * ((chunk + 15) // 16) for h in range(1, 9)}
    sizes = {}
    for head, size in forms.items():
        probe = bytes([head >> 8, head & 255]) + bytes(size - 2)
        if content_count(probe) == chunk:
            sizes[head] = size
    _SIZES[chunk] = sizes
    return sizes


def checked_op(op: BlendOp, chunk: int) -> SingleOp | None:
    """:func:`single_op` of a typed op (not an :class:`AddColumns`)."""
    # exact types, the common one first: a subclass could change what the fields mean
    if type(op) is AddOp:
        tokens, chunk_hash, offset, namespace = op
        return single_op(ADD, tokens, chunk_hash, offset, namespace, chunk)
    if type(op) is RemoveClaimOp:
        tokens, chunk_hash, namespace = op
        return single_op(REMOVE_CLAIM, tokens, chunk_hash, 0, namespace, chunk)
    if type(op) is RemoveChunkOp:
        tokens, chunk_hash = op
        return single_op(REMOVE_CHUNK, tokens, chunk_hash, 0, None, chunk)
    raise ValueError(f"not a blend index op: {op!r}")


SMALL_BATCH = 8
"""A vouched batch of at most this many ops is applied op by op with scalars
(:func:`vouched_singles`): the columns' fixed cost (≈30 µs a batch: masks, bookkeeping,
≈30 small numpy calls) is more than this many single writes (≈4–6 µs each) cost above the
columns' ≈3 µs an op (crossover measured between 8 and 12; docs/performance.md, "Directory:
design figures")."""


def vouched_singles(op: AddColumns | RemoveClaimColumns) -> list[SingleOp] | None:
    """The single ops a small vouched ``op`` stands for (its ``rows()``, unchecked: its
    contents are the directory's own; ``owned`` never), or ``None``: not vouched, more than
    :data:`SMALL_BATCH` ops, or columns of different lengths (then the columns path, which
    applies what it can, decides)."""
    if not op.vouched or len(op.tokens) > SMALL_BATCH:
        return None
    try:  # (a ValueError: columns of different lengths)
        if isinstance(op, AddColumns):
            return [(ADD, t, h, o, ns, False) for t, h, o, ns in op.rows()]
        return [(REMOVE_CLAIM, t, h, 0, ns, False) for t, h, ns in op.rows()]
    except ValueError:
        return None


def _singles(ops: list[SingleOp]) -> OpColumns:
    """Validated single ops as columns."""
    kinds, contents, hashes, offsets, namespaces, owned = zip(*ops, strict=True)
    tokens: list[Tokens] = list(contents)
    widths = np.fromiter(map(token_width, tokens), np.int64, len(tokens))
    spaces: dict[BlendNamespace, int] = {}
    by_id = {id(None): -1}  # a namespace hashes once per object, not once per op
    space_of = []
    for ns in namespaces:
        s = by_id.get(id(ns))
        if s is None:
            s = by_id[id(ns)] = spaces.setdefault(ns, len(spaces))
        space_of.append(s)
    return OpColumns(
        np.array(kinds, np.int64),
        tokens,
        list(hashes),
        byte_lengths(hashes),
        np.array(offsets, np.int64),
        widths,
        list(spaces),
        np.array(space_of, np.int64),
        np.array(owned, np.bool_),
        addresses(tokens, widths),
        set(map(type, tokens)) == {bytes},
    )


def addresses(tokens: list[Tokens], widths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The address of each content's or array's ids (one compiled pass where the CPython
    layout was located)."""
    n = len(tokens)
    layout = _cpython.OBJECT_LAYOUT
    out = np.empty(n, np.int64)
    if layout is None:  # pragma: no cover - not CPython + numpy
        for i, t in enumerate(tokens):
            out[i] = (
                id(t) + _cpython.BYTES_DATA_OFFSET + (0 if widths[i] == 1 else int(widths[i]))
                if isinstance(t, bytes)
                else t.ctypes.data
            )
        return out
    handles = object_handles(tokens)
    token_addresses(
        handles, layout.ob_type, id(bytes), _cpython.BYTES_DATA_OFFSET,
        _cpython.ARRAY_DATA_OFFSET, widths, out,
    )  # fmt: skip
    return out


def op_columns(ops: Iterable[BlendOp], chunk: int) -> OpColumns | None:
    """The ops as one :class:`OpColumns`, in order (``None``: nothing to apply). Raises
    ``ValueError`` (applying nothing) when an op is invalid."""
    parts: list[OpColumns] = []
    singles: list[SingleOp] = []
    for op in ops:
        if type(op) is AddColumns or type(op) is RemoveClaimColumns:
            whole = _kept_columns(op, chunk) if isinstance(op, AddColumns) else _claim_columns(op)
            if whole is None:
                singles += filter(None, [checked_op(one, chunk) for one in op.ops()])
                continue
            if singles:
                parts.append(_singles(singles))
                singles = []
            if len(whole):
                parts.append(whole)
        else:
            one = checked_op(op, chunk)
            if one is not None:
                singles.append(one)
    if singles:
        parts.append(_singles(singles))
    if len(parts) <= 1:
        return parts[0] if parts else None
    return _joined(parts)


def _kept_columns(op: AddColumns, chunk: int) -> OpColumns | None:
    """``op`` as columns if the index can keep every array as it is and every hash and offset
    is valid as given (checked column-wise, unless ``op.vouched`` says so); else ``None``."""
    tokens, hashes = list(op.tokens), list(op.chunk_hashes)
    n = len(tokens)
    spaces = list(op.namespaces)
    try:
        offsets = np.asarray(op.token_offsets)
        which = np.zeros(n, np.int64) if op.namespace_of is None else np.asarray(op.namespace_of)
    except (TypeError, ValueError):
        return None
    if not (len(hashes) == len(offsets) == len(which) == n):
        return None
    if n == 0:
        return _EMPTY
    if op.vouched:
        widths, addrs, id_bytes = vouched_addresses(tokens)
        return _columns(
            tokens, widths, hashes, byte_lengths(hashes), offsets, spaces, which,
            addrs=addrs, id_bytes=id_bytes,
        )  # fmt: skip
    if offsets.dtype.kind not in "iu" or which.dtype.kind not in "iu":
        return None
    checked = checked_objects(tokens, hashes, chunk)
    if checked is None:
        return None
    if int(offsets.min()) < 0 or int(offsets.max()) >= 1 << 63:
        return None
    if int(which.min()) < 0 or int(which.max()) >= len(spaces):
        return None
    return _columns(*checked, offsets, spaces, which)


def _claim_columns(op: RemoveClaimColumns) -> OpColumns | None:
    """A vouched ``op`` as columns as it is (the directory's own contents and hashes); else
    ``None`` (checked as the ops it stands for)."""
    if not op.vouched:
        return None
    tokens, hashes = list(op.tokens), list(op.chunk_hashes)
    n = len(tokens)
    which = np.zeros(n, np.int64) if op.namespace_of is None else np.asarray(op.namespace_of)
    if not (len(hashes) == len(which) == n) or which.dtype.kind not in "iu":
        return None
    if n == 0:
        return _EMPTY
    widths, addrs, id_bytes = vouched_addresses(tokens)
    return _columns(
        tokens, widths, hashes, byte_lengths(hashes), np.zeros(n, np.int64), list(op.namespaces),
        which, REMOVE_CLAIM, addrs, id_bytes,
    )  # fmt: skip


def _columns(
    tokens: list[Tokens],
    token_bytes: npt.NDArray[np.int64],
    hashes: list[bytes],
    hash_lens: npt.NDArray[np.int64],
    offsets: npt.NDArray[Any],
    spaces: list[BlendNamespace],
    which: npt.NDArray[Any],
    kind: int = ADD,
    addrs: npt.NDArray[np.int64] | None = None,
    id_bytes: int | None = None,
) -> OpColumns:
    """The adds (or ``kind``) of valid columns (contents the index keeps as they are);
    ``addrs``: the address of each one's ids, when already read; ``id_bytes``: the bytes of
    their ids when read with the addresses (every one a ``bytes`` content)."""
    n = len(tokens)
    return OpColumns(
        filled(n, kind),
        tokens,
        hashes,
        hash_lens,
        offsets.astype(np.int64),
        token_bytes,
        spaces,
        which.astype(np.int64),
        np.zeros(n, np.bool_),
        addresses(tokens, token_bytes) if addrs is None else addrs,
        id_bytes is not None or set(map(type, tokens)) == {bytes},
        id_bytes,
    )


def vouched_addresses(
    tokens: list[Tokens],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int | None]:
    """Each vouched content's or array's bytes per id and the address of its ids, and the
    bytes of all their ids (headers not counted) when every one is a ``bytes`` content (else
    ``None``): for ``bytes`` contents (what the directory stores) one compiled pass over their
    headers (``contents.vouched_layout``), no call per content; else :func:`token_widths` and
    :func:`addresses`."""
    n = len(tokens)
    layout = _cpython.OBJECT_LAYOUT
    if layout is not None and n and type(tokens[0]) is bytes:
        widths, addrs = np.empty(n, np.int64), np.empty(n, np.int64)
        handles = object_handles(tokens)
        data_off = _cpython.BYTES_DATA_OFFSET
        id_bytes = vouched_layout(handles, tuple(layout), id(bytes), data_off, widths, addrs)
        if id_bytes >= 0:
            return widths, addrs, int(id_bytes)
    widths = token_widths(tokens)
    return widths, addresses(tokens, widths), None


def _joined(parts: list[OpColumns]) -> OpColumns:
    """The parts' ops in order, as one; a namespace several parts name (equal, as the index
    keys them) listed once, so that batches of one namespace join as one namespace's ops
    (the write's one-namespace paths: ``IndexState._apply_batch``, ``_settle``)."""
    ids: dict[BlendNamespace, int] = {}
    space_of = []
    for p in parts:
        if p.spaces:
            joined_ids = np.array([ids.setdefault(s, len(ids)) for s in p.spaces], np.int64)
            space_of.append(np.where(p.space_of >= 0, joined_ids[p.space_of], -1))
        else:
            space_of.append(p.space_of)  # (every op without a namespace: -1)
    spaces = list(ids)
    return OpColumns(
        np.concatenate([p.kinds for p in parts]),
        list(chain.from_iterable(p.tokens for p in parts)),
        list(chain.from_iterable(p.hashes for p in parts)),
        np.concatenate([p.hash_lens for p in parts]),
        np.concatenate([p.offsets for p in parts]),
        np.concatenate([p.token_bytes for p in parts]),
        spaces,
        np.concatenate(space_of),
        np.concatenate([p.owned for p in parts]),
        np.concatenate([p.addrs for p in parts]),
        all(p.contents for p in parts),
        None if any(p.id_bytes is None for p in parts) else sum(p.id_bytes or 0 for p in parts),
    )


_NONE = np.empty(0, np.int64)
_EMPTY = OpColumns(
    _NONE, [], [], _NONE, _NONE, _NONE, [], _NONE, np.empty(0, np.bool_), _NONE, True, 0
)


def _shareable(arr: npt.NDArray[Any]) -> bool:
    """Keep a caller's array only if nobody can change it under us and it pins no larger
    buffer (a read-only view of a 1M-token request must not keep the whole request alive)."""
    flags = arr.flags.num
    if flags & (C_CONTIGUOUS | WRITEABLE) != C_CONTIGUOUS:
        return False
    if flags & OWNDATA:
        return True
    base = arr.base
    return isinstance(base, bytes) and len(base) == arr.nbytes


def _hash_bytes(chunk_hash: Any) -> bytes:
    """The chunk hash as an exact ``bytes`` object (kept by reference, read by address)."""
    raw = chunk_hash if type(chunk_hash) is bytes else bytes(chunk_hash)
    if len(raw) > HASH_WIDTH:
        raise ValueError(f"chunk_hash must be at most {HASH_WIDTH} bytes, got {len(raw)}")
    return raw


def _offset(token_offset: Any) -> int:
    offset = operator.index(token_offset)
    if not 0 <= offset < 1 << 63:
        raise ValueError(f"token_offset must be >= 0, got {offset}")
    return offset
