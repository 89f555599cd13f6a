"""Raw memory access for the kernels: integer addresses read as typed pointers, and prefetch.

The index keeps token arrays by reference (shared with the directory, never copied) and hands
the kernels their addresses, and a write hands them its chunk_hash's; these intrinsics turn
such an address back into a pointer. A prefetch is a hint only: it never faults and never changes a
value, so a wrong address costs speed, never correctness.
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvatlas.kernel_twins import njit_without_nrt

jit = numba.njit(cache=True)
"""How a kernel is compiled: cached on disk, the GIL held for the call. A short call that
released the GIL would starve other threads: each release wakes a thread
waiting for the GIL, the caller takes it back first, and the waiter sleeps again with its
switch interval restarted (so a snapshot beside a thread ingesting small batches starves;
docs/directory.md, "Threads and the GIL")."""

releasing = numba.njit(cache=True, nogil=True)
"""For kernels whose calls are always long (a table rebuilt, a claims rehash): the GIL
released for the call, so other threads run meanwhile. A kernel called both short and long (a
scan, a batch of writes) is compiled both ways by ``kvatlas.kernel_twins.gil_twins``."""

helper = njit_without_nrt(cache=True)
"""For the helpers the kernels call once an op or a window (a lookup in the table, an occupant
linked, a fingerprint, a planes-form comparison): they allocate nothing, and are compiled
without reference counting (``kernel_twins.njit_without_nrt``)."""

inline = numba.njit(cache=True, inline="always")
"""For the small helpers of the hot loops: inlined at numba IR level so loops stay SIMD."""


def _pointer_cast(item: Any) -> Any:
    """An intrinsic reinterpreting an integer address as a pointer to ``item``."""

    def cast(typingctx: Any, addr: Any) -> Any:
        sig = types.CPointer(item)(addr)  # type: ignore[no-untyped-call]

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    cast.__name__ = cast.__qualname__ = f"{item}_ptr"
    return intrinsic(cast)


u32_ptr = _pointer_cast(types.uint32)
"""``uint32*`` at an address: a token array shared with the directory."""
u16_ptr = _pointer_cast(types.uint16)
"""``uint16*`` at an address: a compact token array (every id below 2^16)."""
u8_ptr = _pointer_cast(types.uint8)
"""``uint8*`` at an address: a chunk_hash's bytes (a writer's ``bytes``, an occupant's row)."""
i64_ptr = _pointer_cast(types.int64)
"""``int64*`` at an address: a field of a Python object (an ndarray's data pointer)."""
i32_ptr = _pointer_cast(types.int32)
"""``int32*`` at an address: an index array seen through a write context (``writes.py``)."""
u64_ptr = _pointer_cast(types.uint64)
"""``uint64*`` at an address: an index array seen through a write context (``writes.py``)."""


def _emit_prefetch(builder: Any, ptr: Any) -> None:
    """``llvm.prefetch(ptr, read, locality 3 = all cache levels, data)``."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, fnty, "llvm.prefetch.p0"
    )
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])


@intrinsic
def prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Prefetch ``arr[idx]`` (1-D array, no bounds check: a hint only). Lets a kernel request
    the memory of many items before it needs any, so their cache misses overlap instead of
    forming one serial chain per item."""
    sig = types.void(arr, idx)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
            context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
        )
        _emit_prefetch(builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_addr(typingctx: Any, addr: Any) -> Any:
    """:func:`prefetch` of a raw address (a token array's data, a row of a 2-D array)."""
    sig = types.void(addr)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit_prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


BIT_COLUMN = 64
"""Ids :func:`bit_column` reads: one bit of each, one ``uint64``."""


@intrinsic
def bit_column(typingctx: Any, addr: Any, shift: Any) -> Any:
    """Bit ``shift`` (< 32) of each of the :data:`BIT_COLUMN` ``uint32`` at ``addr`` (4-byte
    aligned), as one ``uint64`` whose bit ``k`` is that of the ``k``-th id: the
    planes form's layout (``planes.py``) of a block of 64 ids, gathered from them.

    Written as one vector operation (load, shift, truncate to 64 single bits, reinterpret as
    an integer) so the compiler emits a mask extraction (``vpmovd2m`` with AVX-512,
    ``vmovmskps`` with AVX2) instead of 64 scalar shift-and-or steps; a loop written in
    Python does not compile to it. Element ``k`` lands in bit ``k`` on little-endian hosts,
    the only ones kvatlas runs on (``tests/directory/test_token_verification.py``)."""
    sig = types.uint64(types.int64, types.uint32)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        address, bit = args
        i32 = ir.IntType(32)
        vector = ir.VectorType(i32, BIT_COLUMN)
        ids = builder.load(builder.inttoptr(address, vector.as_pointer()), align=4)
        undef = ir.Constant(vector, ir.Undefined)
        first = builder.insert_element(undef, bit, ir.Constant(i32, 0))
        shifts = builder.shuffle_vector(first, undef, ir.Constant(vector, [0] * BIT_COLUMN))
        bits = builder.trunc(builder.lshr(ids, shifts), ir.VectorType(ir.IntType(1), BIT_COLUMN))
        return builder.bitcast(bits, ir.IntType(BIT_COLUMN))

    return sig, codegen


TILE = 8
"""Ids a side of the square :func:`transpose_tile` turns: eight ``uint32``, one AVX2 vector."""


def _butterfly(step: int) -> tuple[list[int], list[int]]:
    """The two shuffles of a transpose stage pairing rows ``step`` apart (``a``'s elements
    ``0..TILE-1``, ``b``'s ``TILE..2·TILE-1``): the first row keeps ``a``'s blocks of ``step``
    at even block positions and takes ``b``'s into the odd ones; the second row the other
    halves."""
    first = [k if not k & step else TILE + k - step for k in range(TILE)]
    second = [k + step if not k & step else TILE + k for k in range(TILE)]
    return first, second


@intrinsic
def transpose_tile(typingctx: Any, src: Any, src_row: Any, dst: Any, dst_row: Any) -> Any:
    """Write the transpose of a :data:`TILE` × :data:`TILE` tile of ``uint32``: row ``j`` of the
    tile at ``src + j·src_row`` (bytes), row ``r`` of its transpose to ``dst + r·dst_row``.

    Eight vector loads, three stages of eight shuffles (rows ``4``, ``2``, then ``1`` apart:
    ``vperm2i128``, then in-lane unpacks on AVX2) and eight vector stores, where a loop of
    scalar copies takes a load and a store per id (docs/performance.md, the lane transpose).
    Reads and writes need 4-byte alignment only."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        src, src_row, dst, dst_row = args
        i64 = ir.IntType(64)
        vector = ir.VectorType(ir.IntType(32), TILE)
        rows = [
            builder.load(builder.inttoptr(at, vector.as_pointer()), align=4)
            for at in (
                builder.add(src, builder.mul(src_row, ir.Constant(i64, j))) for j in range(TILE)
            )
        ]
        step = TILE // 2
        while step:
            first, second = _butterfly(step)
            for i in range(TILE):
                if not i & step:
                    a, b = rows[i], rows[i + step]
                    rows[i] = builder.shuffle_vector(a, b, ir.Constant(vector, first))
                    rows[i + step] = builder.shuffle_vector(a, b, ir.Constant(vector, second))
            step //= 2
        for r, row in enumerate(rows):
            at = builder.add(dst, builder.mul(dst_row, ir.Constant(i64, r)))
            builder.store(row, builder.inttoptr(at, vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen
