"""Token storage: how the directory keeps a chunk's token ids — compactly, exactly.

A chunk's content is kept as one ``bytes`` object (``blend/kernels/contents.py``: a small
header, then the ids inline: one allocation, no array object), in one of three forms chosen
per chunk by its largest id (token bytes are most of a directory's memory):

- ``uint16`` when every id is below 2^16 (vocabularies up to 65,536 ids: half the bytes of
  the ``uint32`` the wire carries);
- the planes form when every id is below 2^24 (``blend/kernels/planes.py``: the low 16 bits
  of each id, then one bit plane per high bit the chunk needs: 17 bits per id for Llama 3's
  128,256 ids, 18 for Qwen 2.5's or Gemma's; 546 bytes per 256-token chunk instead of 1,024);
- ``uint32`` otherwise.

No form is a truncation: every id in [0, 2^32) round-trips exactly (:func:`widened` gives the
``uint32`` array public values carry; :func:`stored_view` a read-only array of the form).
The blend index reads every form in place (``blend/kernels/layout.py``).

Entries of one content (a chunk's ranks) sharing one input array get one stored content, so
the directory's "same object, same content" shortcut holds; narrowing is one compiled pass
per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from operator import attrgetter, sub
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend._cpython import (
    ARRAY_DATA_OFFSET,
    BYTES_DATA_OFFSET,
    OBJECT_LAYOUT,
    array_handles,
)
from kvatlas.directory.blend.kernels.contents import (
    content_form,
    content_shapes,
    data_offset,
)
from kvatlas.directory.blend.kernels.contents import token_count as token_count
from kvatlas.directory.blend.kernels.objects import object_handles, payload_addresses, u32_rows
from kvatlas.directory.blend.kernels.planes import (
    FORM_PLANES,
    FORM_U16,
    FORM_U32,
    HEADER,
    MAX_HIGH_BITS,
    PLANES,
    form_of,
    planes_load,
    planes_nbytes,
    planes_store,
)
from kvatlas.directory.blend.kernels.pointers import (
    i64_ptr,
    jit,
    u8_ptr,
    u16_ptr,
    u32_ptr,
)
from kvatlas.errors import PayloadTooLarge
from kvatlas.events.columns import EntryColumns
from kvatlas.keys.tokens import TokenArray

StoredTokens = bytes
"""A chunk's content as the directory keeps it (``blend/kernels/contents.py``): immutable,
its ids inline after a header naming their form."""
COMPACT_LIMIT = 1 << 16
"""Ids below this fit the compact (``uint16``) form."""

_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)
FORM_DTYPES: dict[int, np.dtype[Any]] = {FORM_U16: _U16, FORM_U32: _U32}
FORM_DTYPES.update((FORM_PLANES + h, PLANES) for h in range(1, MAX_HIGH_BITS + 1))
"""The dtype of a content's view (:func:`stored_view`) in each form (``planes.FORM_*``)."""
_DTYPE = attrgetter("dtype")
_STRIDES = attrgetter("strides")
_frombuffer = np.frombuffer


def stored_form(stored: StoredTokens) -> int:
    """The form code of ``stored`` (``planes.FORM_*``: 2, 4, or 16 + its high bits)."""
    return content_form(stored)


def stored_view(stored: StoredTokens) -> npt.NDArray[Any]:
    """``stored``'s ids as a read-only array of its form (``uint16``, ``uint32``, or the
    planes form's bytes, dtype :data:`PLANES`), a view of the content."""
    form = content_form(stored)
    return _frombuffer(stored, FORM_DTYPES[form], -1, data_offset(form))


def stored_payload(stored: StoredTokens) -> bytes | memoryview:
    """The bytes of ``stored``'s ids in its form, as a snapshot's token section holds them
    (the content without its header; a planes-form content is its own bytes)."""
    high = stored[0]
    return stored if high else memoryview(stored)[stored[1] :]


def widened(stored: StoredTokens) -> TokenArray:
    """The ids of ``stored`` as a read-only ``uint32`` array (a view of it if it is one)."""
    high = stored[0]
    if high:
        n = token_count(stored)
        out = np.empty(n, np.uint32)
        planes_load(out, id(stored) + BYTES_DATA_OFFSET, n)
        out.flags.writeable = False
        return out
    if stored[1] == FORM_U32:
        return _frombuffer(stored, _U32, -1, FORM_U32)
    out = _frombuffer(stored, _U16, -1, FORM_U16).astype(_U32)
    out.flags.writeable = False
    return out


def widened_many(
    contents: Sequence[StoredTokens | None], max_ids: int | None = None
) -> list[TokenArray | None]:
    """:func:`widened` of each content (``None`` stays ``None``), decoded in one compiled pass
    into one read-only ``uint32`` array of which each is a view (a lookup's contents: one
    call instead of one per key). ``PayloadTooLarge`` before anything is allocated when they
    hold more than ``max_ids`` ids (a content is bound whatever its length, and a lookup may
    ask for a key many times)."""
    whole = None not in contents  # (a lookup's usual contents: no list of the present ones)
    present = (
        cast(Sequence[StoredTokens], contents) if whole else [c for c in contents if c is not None]
    )
    if not present:
        return list(contents)  # type: ignore[arg-type]
    counts, forms = stored_shapes(present)
    lengths = counts.tolist()  # (a list: numpy's reductions cost more for a short lookup)
    total = sum(lengths)
    if max_ids is not None and total > max_ids:
        raise PayloadTooLarge(
            f"the contents asked for hold {total:,} token ids, more than {max_ids:,}"
        )
    out = np.empty(total, np.uint32)
    _widen_rows(payload_addresses(present), counts, forms, out)
    out.flags.writeable = False
    if lengths.count(lengths[0]) == len(lengths):  # one length (a lookup's chunks): rows of
        views = iter(out.reshape(len(present), lengths[0]))  # one 2-D view
    else:
        ends = list(accumulate(lengths))
        views = map(out.__getitem__, map(slice, map(sub, ends, lengths), ends))
    if whole:
        return list(views)
    return [None if c is None else next(views) for c in contents]


@jit
def _widen_rows(addrs: Any, counts: Any, forms: Any, out: Any) -> None:
    """Content ``j`` (its bytes at ``addrs[j]``: ``counts[j]`` ids in form ``forms[j]``) as
    ``uint32`` into ``out``, one after the other."""
    start = 0
    for j in range(addrs.shape[0]):
        n, at, form = counts[j], addrs[j], forms[j]
        dst = out[start : start + n]
        start += n
        if form == FORM_U16:
            narrow: Any = u16_ptr(at + FORM_U16)  # type: ignore[call-arg]
            for k in range(n):
                dst[k] = np.uint32(narrow[k])
        elif form == FORM_U32:
            wide: Any = u32_ptr(at + FORM_U32)  # type: ignore[call-arg]
            for k in range(n):
                dst[k] = wide[k]
        else:
            planes_load(dst, at, n)


def stored_equal(a: StoredTokens, b: StoredTokens) -> bool:
    """Whether two stored contents hold the same ids (forms are canonical and the header
    names the form, so contents of one form are equal exactly when their bytes are; of two
    forms, compared widened)."""
    if a is b or a == b:
        return True
    if a[:2] == b[:2]:
        return False
    wa, wb = widened(a), widened(b)
    return wa.shape == wb.shape and bool(np.array_equal(wa, wb))


def stored_one(tokens: npt.NDArray[Any]) -> StoredTokens:
    """``tokens`` (validated ids) as a stored content, in the form its ids need."""
    arena = np.ascontiguousarray(tokens, dtype=np.uint32)
    at, n = np.array([arena.ctypes.data], np.int64), np.array([len(arena)], np.int64)
    (out,) = _stored_rows(at, -1, n)  # (no ids: a content of its own all the same)
    return out


def form_sizes(lens: npt.NDArray[Any], forms: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Bytes of each content stored (``lens[i]`` ids in form ``forms[i]``)."""
    return _sized(lens, forms, False)


def content_sizes(lens: npt.NDArray[Any], forms: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Bytes of each content (``lens[i]`` ids in form ``forms[i]``), its header included."""
    return _sized(lens, forms, True)


def _sized(lens: npt.NDArray[Any], forms: npt.NDArray[Any], headers: bool) -> npt.NDArray[np.int64]:
    out: npt.NDArray[np.int64] = _sizes(
        np.asarray(lens, np.int64), np.asarray(forms, np.int64), headers
    )
    return out


@jit
def _sizes(lens: Any, forms: Any, headers: Any) -> Any:
    """:func:`form_sizes` (or with ``headers``, :func:`content_sizes`) in one pass: a restore
    takes them for 10^6 chunks, which numpy's expression made 8 arrays as long for (each a
    fresh map, faulted in page by page)."""
    out = np.empty(lens.shape[0], np.int64)
    for i in range(lens.shape[0]):
        n, form = lens[i], forms[i]
        if form < FORM_PLANES:
            out[i] = n * form + (form if headers else 0)
        else:
            out[i] = HEADER + 2 * n + (form - FORM_PLANES) * (((n + 15) >> 4) << 1)
    return out


def stored_shapes(
    contents: Sequence[StoredTokens],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """How many ids each stored content holds and its form code (``planes.FORM_*``), in one
    compiled pass (a snapshot reads them for every chunk)."""
    n = len(contents)
    counts = np.empty(n, np.int64)
    forms = np.empty(n, np.int64)
    if OBJECT_LAYOUT is None:  # pragma: no cover - not CPython
        counts[:] = list(map(token_count, contents))
        forms[:] = list(map(content_form, contents))
        return counts, forms
    handles = object_handles(contents)
    if not content_shapes(handles, OBJECT_LAYOUT.size, BYTES_DATA_OFFSET, counts, forms):
        raise ValueError("not a token content (bad header or length)")
    return counts, forms


def stored_batch(arrays: Sequence[TokenArray | None]) -> list[StoredTokens | None]:
    """:func:`stored_one` of each array (``None`` stays ``None``), two compiled passes for
    the batch; entries that share an input array share its stored content. (Per entry this
    is an allocation: the checks run as C-level maps, not as Python code per entry.)"""
    srcs = [a for a in arrays if a is not None]
    fast = _u32_rows(srcs)
    if fast is not None:  # the usual batch: one compiled check instead of three maps
        outs = _stored_rows(*fast)
        if len(outs) == len(arrays):
            return outs  # type: ignore[return-value]
        rows = iter(outs)
        return [None if a is None else next(rows) for a in arrays]
    ids = list(map(id, srcs))
    distinct = dict(zip(ids, srcs, strict=True))
    if len(distinct) != len(srcs):
        srcs = list(distinct.values())
    if not srcs:
        return list(arrays)  # type: ignore[arg-type]
    if set(map(_DTYPE, srcs)) != {_U32} or set(map(_STRIDES, srcs)) != {(4,)}:
        stored = {key: stored_one(a) for key, a in distinct.items()}  # uncommon inputs
        return [None if a is None else stored[id(a)] for a in arrays]
    lens = np.fromiter(map(len, srcs), np.int64, len(srcs))
    outs = _stored_rows(np.array(array_handles(srcs), np.int64), ARRAY_DATA_OFFSET, lens)
    if len(outs) == len(arrays):  # no None, no shared input: entry for entry
        return outs  # type: ignore[return-value]
    by_id = dict(zip(distinct, outs, strict=True))
    return [None if a is None else by_id[id(a)] for a in arrays]


def _u32_rows(
    srcs: list[TokenArray],
) -> tuple[npt.NDArray[np.int64], int, npt.NDArray[np.int64]] | None:
    """The arguments of :func:`_stored_rows` for ``srcs`` when every one is an exact,
    1-D, C-contiguous ``uint32`` ndarray and no two are one object (checked compiled, through
    the CPython layout); ``None`` otherwise (or when no layout was located): the general
    path then takes them."""
    layout = OBJECT_LAYOUT
    n = len(srcs)
    if layout is None or not n:
        return None
    handles = object_handles(srcs)
    lens = np.empty(n, np.int64)
    if not u32_rows(handles, tuple(layout), id(np.ndarray), id(_U32), lens):
        return None  # (also when entries share an array: it is stored once, as theirs)
    return handles, ARRAY_DATA_OFFSET, lens


def _stored_rows(
    srcs: npt.NDArray[np.int64], src_off: int, lens: npt.NDArray[np.int64]
) -> list[StoredTokens]:
    """Stored contents of the ``uint32`` rows ``srcs`` (``lens[j]`` ids each, > 0 or an
    array handle; read through ``src_off`` as ``_data`` reads them): which form each row
    needs, then each content allocated (zeroed ``bytes``, by a C-level map: no Python per
    row) and written in place (its only reference is here until it is returned)."""
    n = len(lens)
    forms = np.empty(n, np.int64)
    sizes = np.empty(n, np.int64)
    _forms(srcs, src_off, lens, forms, sizes)
    outs: list[StoredTokens] = list(map(bytes, sizes.tolist()))
    dsts = payload_addresses(outs)
    _write_rows(srcs, src_off, lens, dsts, forms)
    return outs


def stored_from_arena(
    arena: TokenArray, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> list[StoredTokens | None]:
    """Stored arrays of ``arena[starts[j]:starts[j] + lengths[j]]`` (length 0: ``None``), each
    a content of its own (never a view that would pin the arena): three compiled passes for
    all (the rows checked and their addresses, which form each row needs, then the copies
    into contents of that form)."""
    arena = np.ascontiguousarray(arena, dtype=np.uint32)
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    if len(starts) != len(lengths):
        raise ValueError("token rows outside the arena")
    addresses = np.empty(len(starts), np.int64)
    empty = _arena_rows(arena, starts, lengths, addresses)
    if empty < 0:
        raise ValueError("token rows outside the arena")
    if not empty:  # no empty row (the usual batch): no mask, no None
        return _stored_rows(addresses, -1, lengths)  # type: ignore[return-value]
    present = lengths > 0
    it = iter(_stored_rows(addresses[present], -1, lengths[present]))
    return [next(it) if n else None for n in lengths.tolist()]


@jit
def _arena_rows(arena: Any, starts: Any, lengths: Any, addresses: Any) -> Any:
    """``addresses[j]``: where row ``j`` (``lengths[j]`` ids from ``starts[j]``) starts in
    ``arena``; the count of empty rows, or -1 when a row is not inside the arena (then the
    addresses are not all written)."""
    size = arena.shape[0]
    base = arena.ctypes.data
    empty = 0
    for j in range(starts.shape[0]):
        start, n = starts[j], lengths[j]
        if start < 0 or n < 0 or start > size or n > size - start:
            return -1
        addresses[j] = base + 4 * start
        if n == 0:
            empty += 1
    return empty


def stored_columns(cols: EntryColumns) -> list[StoredTokens | None]:
    """Each entry's tokens of a columnar batch, stored (contents the directory made, so
    their index adds may be vouched for): straight from the batch's arena when no two
    entries share a row (the usual body; a token-less entry has no row, though its start is
    the next entry's), else through :meth:`EntryColumns.token_arrays`, which gives entries
    of one content one array (and so one stored content)."""
    if cols.token_objects is None and not cols.rows_shared():
        return stored_from_arena(cols.tokens, cols.token_starts, cols.token_lengths)
    return stored_batch(cols.token_arrays())


@jit
def _data(handle: Any, data_off: Any) -> Any:
    """The data address of an array handed over as ``array_handles`` gives it (``data_off``
    < 0: the handle is the address)."""
    return i64_ptr(handle + data_off)[0] if data_off >= 0 else handle  # type: ignore[call-arg]


@jit
def _forms(srcs: Any, src_off: Any, lens: Any, forms: Any, sizes: Any) -> None:
    """Per row: ``forms[j]`` = the form its ids need (by the OR of its ``uint32`` ids, read
    through a pointer: no index checks, the loop runs SIMD) and ``sizes[j]`` = the bytes of
    its content (header included)."""
    for j in range(srcs.shape[0]):
        n = lens[j]
        a: Any = u32_ptr(_data(srcs[j], src_off))  # type: ignore[call-arg]
        high = np.uint32(0)
        for k in range(n):
            high |= a[k]
        form = form_of(high, n)
        forms[j] = form
        sizes[j] = form * (n + 1) if form < FORM_PLANES else planes_nbytes(n, form - FORM_PLANES)


@jit
def _write_rows(srcs: Any, src_off: Any, lens: Any, dsts: Any, forms: Any) -> None:
    """Row ``j`` (``uint32`` ids) into the zeroed content at address ``dsts[j]`` in form
    ``forms[j]``, header first (``blend/kernels/contents.py``)."""
    for j in range(srcs.shape[0]):
        n = lens[j]
        src = _data(srcs[j], src_off)
        dst = dsts[j]
        a: Any = u32_ptr(src)  # type: ignore[call-arg]
        form = forms[j]
        if form == FORM_U16:
            u8_ptr(dst)[1] = np.uint8(FORM_U16)  # type: ignore[call-arg]
            b: Any = u16_ptr(dst + FORM_U16)  # type: ignore[call-arg]
            for k in range(n):
                b[k] = np.uint16(a[k])
        elif form == FORM_U32:
            u8_ptr(dst)[1] = np.uint8(FORM_U32)  # type: ignore[call-arg]
            w: Any = u32_ptr(dst + FORM_U32)  # type: ignore[call-arg]
            for k in range(n):
                w[k] = a[k]
        else:
            planes_store(src, n, dst, form - FORM_PLANES)


def empty_contents(
    sizes: npt.NDArray[np.int64], present: npt.NDArray[np.bool_]
) -> list[bytes | None]:
    """A zeroed content of ``sizes[i]`` bytes (:func:`content_sizes`) for each chunk
    ``present`` selects (``None`` for the others: no ids), to be filled (a restore's
    ``snapshot.token_section.fill_piece``) before anyone reads it: one allocation each, by a
    C-level map."""
    if bool(present.all()):
        return list(map(bytes, sizes.tolist()))  # type: ignore[arg-type]
    made = iter(map(bytes, sizes[present].tolist()))
    return [next(made) if p else None for p in present.tolist()]
