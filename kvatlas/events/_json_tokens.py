"""Parse the ``token_ids`` JSON arrays of a whole body in one compiled pass.

msgspec hands each entry's ``token_ids`` over as raw JSON text (``msgspec.Raw``, no Python int
per token); this kernel parses them all into one uint32 arena, validating strictly: only
non-negative integers below 2**32, no fractions, exponents or leading zeros. Token lists are
most of a JSON body, so this pass is most of the JSON ingest cost (docs/performance.md).

This module imports numba: ``json_codec`` imports it on first use only, so that importing
``kvatlas.events`` (and every client) stays free of numba. Keep it that way.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.events._json_words import (
    ABOVE_NINE,
    ALL_BITS,
    BLOCK,
    ONES,
    TOP_BIT,
    TOPS,
    U64_1,
    U64_8,
    U64_64,
    ZEROS,
    digits_value,
    masks,
    trailing_zeros,
    values4,
    word,
)
from kvatlas.kernel_twins import gil_twins, njit_without_nrt, releasing_twin


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _is_space(c: int) -> bool:  # pragma: no cover - compiled
    return c == 32 or c == 9 or c == 10 or c == 13


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _digit(c):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The digit ``c`` stands for, or -1."""
    d = np.int64(c) - 48
    return d if 0 <= d <= 9 else -1


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _short_number(x):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``(digits, value)`` of the number that eight bytes ``x`` (little-endian) start with,
    read without a branch per byte; ``digits`` 0 when it is not 1–7 digits followed by a
    byte in the word, or has a leading zero (the caller then reads it byte by byte).
    A non-digit byte is one whose top bit is set after ``- '0'`` (below '0') or ``+ 0x46``
    (above '9'); a borrow or carry only reaches bytes after the first non-digit."""
    stops = ((x - ZEROS) | (x + ABOVE_NINE)) & TOPS
    if stops == 0:
        return 0, np.uint64(0)
    bits = trailing_zeros(stops) - np.uint64(7)  # type: ignore[call-arg]  # 8 x the digits
    if bits == 0 or (bits > U64_8 and (x & np.uint64(0xFF)) == np.uint64(48)):
        return 0, np.uint64(0)
    return np.int64(bits >> np.uint64(3)), digits_value(x, bits)


_QUOTES = np.uint64(0x2222222222222222)
_BACKSLASHES = np.uint64(0x5C5C5C5C5C5C5C5C)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _zero_bytes(x):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Non-zero iff a byte of ``x`` is 0; its lowest set bit marks the first such byte (a
    borrow only reaches the bytes after it)."""
    return (x - ONES) & ~x & TOPS


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def string_end(buf, i, n):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The index of the first ``"`` or ``\\`` at or after ``i`` (``n`` if none before ``n``),
    eight bytes at a time."""
    while i + 8 <= n:
        x = word(buf, i)  # type: ignore[call-arg]
        stops = _zero_bytes(x ^ _QUOTES) | _zero_bytes(x ^ _BACKSLASHES)
        if stops != 0:
            return i + np.int64(trailing_zeros(stops) >> np.uint64(3))  # type: ignore[call-arg]
        i += 8
    while i < n and buf[i] != 34 and buf[i] != 92:
        i += 1
    return i


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def skip_space(buf, i, n):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    while i < n and _is_space(buf[i]):
        i += 1
    return i


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _zero_led(buf, b, start, digits, zeros):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether a number of the block at ``b`` (its masks ``digits`` and ``zeros``; the current
    number starting at ``start`` <= ``b``) may have a leading zero: the number carried over
    from the block before starts with ``0``, or a ``0`` starts a number here and a digit
    follows it (or the next block's first byte does: not known here)."""
    carried = start < b
    if carried and buf[start] == 48:
        return True
    before = (digits << U64_1) | (U64_1 if carried else np.uint64(0))  # a digit before
    starts = digits & ~before
    return (starts & zeros & ((digits >> U64_1) | TOP_BIT)) != 0


@njit_without_nrt(cache=True, nogil=True, boundscheck=False, inline="always")
def _next(buf, b, stops, start, bad):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The next number of a block of digits and commas (at ``b``; ``stops`` its commas not
    read yet, ``start`` the number's first byte): ``(word, shift, stops, start, bad)`` for
    :func:`values4`, the commas and first byte after it, and ``bad`` not 0 once a number had
    no digit or more than 8 (its shift then meaningless)."""
    p = b + np.int64(trailing_zeros(stops))  # type: ignore[call-arg]
    digits = p - start
    shift = (U64_64 - np.uint64(8 * digits)) & np.uint64(63)
    x = word(buf, start)  # type: ignore[call-arg]
    return x, shift, stops & (stops - U64_1), p + 1, bad | ((digits - 1) >> 3)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _usual_numbers(buf, i, n, arena, k):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Read the numbers of an int array from ``i`` (its first number's first byte) while
    they come in the usual form: 1–8 digits, no leading zero, each followed by ``,`` (and
    spaces) or by the closing ``]``. Returns ``(closed, i, k)``: whether it read the
    ``]`` (then ``i`` is just after it), else ``i`` is the first number it did not read (or
    the space before it), where :func:`parse_array`'s loop goes on as if it had read them all
    itself; ``k`` the arena's new fill.

    By blocks of :data:`BLOCK` bytes: masks of the block's digit bytes (and commas and
    zeros), then each number is read where it lies, between two non-digits of the mask. The
    byte-by-byte loop can only find a number's start once it has read the number before;
    here the next start comes from the mask, and the numbers of a block are read
    independently. A block of digits and commas only with no leading zero in it (most of a
    compact list: all but its last block) is checked once for all its numbers; each then
    needs only its length checked (1–8 digits), and they are converted four at a time
    (:func:`values4`). Any other block is read number by number, each separator and leading
    digit checked."""
    start = i  # the current number's first byte
    b = i
    # (a block read only with room for a word at any number in it and for its numbers, at
    # most 32: no bounds check per number)
    while b + BLOCK + 8 <= n and k + BLOCK // 2 <= len(arena):
        digits_at, commas_at, zeros_at = masks(buf, b)  # type: ignore[call-arg]
        if (
            (digits_at | commas_at) == ALL_BITS
            and (commas_at & (commas_at >> U64_1)) == 0  # (at most 32 numbers then)
            and not _zero_led(buf, b, start, digits_at, zeros_at)
        ):
            stops = commas_at
            before = start, k
            bad = np.int64(0)  # any number of no digit (",,") or more than 8
            while stops != 0:  # four numbers at a time (fewer at the block's end)
                x1 = x2 = x3 = s1 = s2 = s3 = np.uint64(0)
                x0, s0, stops, start, bad = _next(buf, b, stops, start, bad)
                count = 1
                if stops != 0:
                    x1, s1, stops, start, bad = _next(buf, b, stops, start, bad)
                    count = 2
                    if stops != 0:
                        x2, s2, stops, start, bad = _next(buf, b, stops, start, bad)
                        count = 3
                        if stops != 0:
                            x3, s3, stops, start, bad = _next(buf, b, stops, start, bad)
                            count = 4
                values4(arena, k, x0, x1, x2, x3, s0, s1, s2, s3)  # type: ignore[call-arg]
                k += count
            if bad == 0:
                b += BLOCK
                continue
            start, k = before  # the block again, number by number: which one, and where
        stops = ~digits_at
        while stops != 0:
            p = b + np.int64(trailing_zeros(stops))  # type: ignore[call-arg]
            stops &= stops - np.uint64(1)
            digits = p - start
            c = buf[p]
            if digits == 0:  # a space after a comma (a byte after ``,`` or another space)
                if c == 32:
                    start = p + 1
                    continue
                return False, start, k
            x = word(buf, start)  # type: ignore[call-arg]
            if (
                (digits > 8)
                | ((digits > 1) & ((x & np.uint64(0xFF)) == np.uint64(48)))
                | ((c != 44) & (c != 93))
            ):
                return False, start, k
            arena[k] = digits_value(x, np.uint64(8 * digits))
            k += 1
            if c == 93:
                return True, p + 1, k
            start = p + 1
        b += BLOCK
    return False, start, k


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def parse_array(buf, i, n, arena, k):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse the JSON int array at ``buf[i]`` (``i`` must point at its ``[``, ``n`` bounds
    the text) into ``arena[k:]``; returns ``(end, k)``: the index just after its ``]`` and
    the new fill of the arena, or ``end == -1`` when it is not a valid array of integers in
    [0, 2**32) (or the arena is full). The common separator (a comma right after a number)
    is checked first; a number is read to at most 10 digits (an 11th: too large)."""
    cap = len(arena)
    i = skip_space(buf, i + 1, n)
    if i < n and buf[i] == 93:  # ']': the empty list
        return i + 1, k
    closed, i, k = _usual_numbers(buf, i, n, arena, k)
    if closed:
        return i, k
    while i < n:  # from the first number not in the usual form, if any
        digits, v = 0, np.int64(0)
        if i + 8 <= n:  # the common number: 1-7 digits and the byte after, read as one word
            digits, value = _short_number(word(buf, i))  # type: ignore[call-arg]
            v = np.int64(value)  # (int64: mixed with uint64, numba would compute in float64)
        if digits != 0:
            i += digits
        else:  # byte by byte
            d = _digit(buf[i])
            if d < 0:  # white space before a number
                i = skip_space(buf, i, n)
                if i >= n:
                    break
                d = _digit(buf[i])
                if d < 0:
                    break
            i += 1
            v = d
            if d == 0:
                if i < n and _digit(buf[i]) >= 0:
                    break  # leading zero
            else:  # at most 10 digits (no overflow in int64), then one range check
                stop = min(i + 9, n)
                while i < stop:
                    e = _digit(buf[i])
                    if e < 0:
                        break
                    v = v * 10 + e
                    i += 1
                if v > 4294967295 or (i < n and _digit(buf[i]) >= 0):
                    break
        if k >= cap:
            break
        arena[k] = v
        k += 1
        if i < n and buf[i] == 44:  # ',' right after the number
            i += 1
            continue
        i = skip_space(buf, i, n)
        if i < n and buf[i] == 44:
            i += 1
            continue
        if i < n and buf[i] == 93:  # ']'
            return i + 1, k
        break
    return -1, k


RELEASE_BYTES = 1 << 18
"""Bodies of at least this many bytes are parsed with the GIL released: a parse this long
lets a waiting thread run meanwhile (one body decoded while another is applied). Smaller
ones, what a node sends per batch, hold it: a release per short parse would wake a waiting
thread only to starve it (``kvatlas/kernel_twins.py``; the figures: docs/performance.md,
"Directory: design figures")."""


@gil_twins(boundscheck=False)
def _parse_lists(buf, starts, ends, arena, lengths):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse ``buf[starts[j]:ends[j]]`` as a JSON int array (or ``null``: length 0) into
    ``arena``; returns the index of the first invalid list, or -1 when all are valid.
    ``lengths[j]`` gets each count."""
    k = 0
    for j in range(len(starts)):
        n = ends[j]
        i = skip_space(buf, starts[j], n)
        if i + 4 <= n and buf[i] == 110:  # "null": no tokens, as an empty list
            if buf[i + 1] != 117 or buf[i + 2] != 108 or buf[i + 3] != 108:
                return j
            if skip_space(buf, i + 4, n) != n:
                return j
            lengths[j] = 0
            continue
        if i >= n or buf[i] != 91:  # '['
            return j
        end, filled = parse_array(buf, i, n, arena, k)
        if end < 0 or skip_space(buf, end, n) != n:
            return j
        lengths[j] = filled - k
        k = filled
    return -1


_parse_lists_releasing = releasing_twin(_parse_lists)
""":func:`_parse_lists`, the GIL released for the call."""


def parse_token_lists(
    raws: Sequence[bytes | msgspec.Raw],
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64], int]:
    """Parse JSON int arrays (``null`` reads as empty); returns ``(arena, lengths, bad)`` where
    ``bad`` is the index of the first invalid list (-1 if none). List ``j`` occupies
    ``arena[offsets[j]:...]``. ``raws`` may be msgspec's ``Raw`` slices of a body: joined in
    one copy, never converted one by one."""
    joined = b"".join(raws)  # type: ignore[arg-type]  # Raw has the buffer protocol
    buf = np.frombuffer(joined, dtype=np.uint8)
    sizes = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
    ends = np.cumsum(sizes)
    starts = ends - sizes
    arena = np.empty(len(joined) // 2 + 1, dtype=np.uint32)  # a token needs >= 2 bytes ("1,")
    lengths = np.zeros(len(raws), dtype=np.int64)
    parse = _parse_lists_releasing if len(buf) >= RELEASE_BYTES else _parse_lists
    bad = int(parse(buf, starts, ends, arena, lengths)) if raws else -1
    return arena, lengths, bad
