"""Parse a JSON batch's ``entries`` array into columns in one compiled pass (the token cut's
part for entries: ``_json_cut.py``).

Every entry becomes a row of integer columns (``_cut_types.COLUMNS``), its chunk hash 32 bytes of
``hashes``, its token ids a run of the arena, its model name and cache salt spans of the body
(decoded once per run of entries of one key shape, not once per entry); the small body keeps
``"entries":[]``, so msgspec builds no object per entry.

Invariant: an entry is taken only in the form whose meaning is certain — the fields of
``EventEntry`` and ``EventKey`` each at most once, in any order, with white space anywhere
JSON allows; strings without escapes or control characters; integers without fraction,
exponent, leading zero or ``-0``, of at most 18 digits; ``size_bytes`` at least 0 and
``token_offset`` at least -1 (unknown); ``token_ids`` an array read by ``parse_array`` or
``null``. Anything else (a field the struct would ignore or refuse, a wrong type, a missing
required field, a size or offset out of range) gives up (``-1``): the caller then decodes the
body the per-entry way, which accepts or words the error. So a body taken here yields what
msgspec and the per-entry checks would have; what those checks refuse of the key (a bad
shape) is for the caller to check on the columns.

This module imports numba: ``json_codec`` imports it on first use only (through
``_json_cut``). numba caches a caller's machine code with its callees compiled in, keyed by
the caller's file: after a change here, clear ``__pycache__/_json_cut*.nb?``.
"""

from __future__ import annotations

import numpy as np

from kvatlas.api.events import UNKNOWN_OFFSET
from kvatlas.events._cut_types import (
    GROUP,
    KV_RANK,
    MODEL_AT,
    MODEL_END,
    OFFSET,
    RUN,
    SALT_AT,
    SALT_END,
    SIZE,
    START,
    TOKENS,
)
from kvatlas.events._json_tokens import parse_array, skip_space, string_end
from kvatlas.kernel_twins import njit_without_nrt

# an entry's fields, then its key's (bits of the fields seen)
_KEY, _SIZE, _TOKENS, _OFFSET = 0, 1, 2, 3
_HASH, _MODEL, _RANK, _GROUP, _SALT = 0, 1, 2, 3, 4
_NAME_LIST = (
    b"key", b"size_bytes", b"token_ids", b"token_offset",  # an entry's fields
    b"chunk_hash_hex", b"model_name", b"kv_rank", b"object_group_id", b"cache_salt",  # a key's
    b"null",
)  # fmt: skip
NAMES = np.frombuffer(b"".join(_NAME_LIST), np.uint8)
"""The names the parser knows, one after the other (where each starts: :data:`NAME_ENDS`).
The kernels read these tables as globals (numba compiles them in as constants), not as
arguments handed down through every helper."""
NAME_ENDS = np.cumsum([0, *map(len, _NAME_LIST)]).astype(np.int64)
"""Where each of :data:`NAMES` starts (and the last ends)."""
_ENTRY_FIELDS, _KEY_FIELDS, _NULL_NAME = (0, 4), (4, 9), 9
HEX_VALUES = np.full(256, -1, np.int8)
"""Each byte's value as a hex digit (either case), or -1 (a table: hex digits are random, a
branch per digit is mispredicted a third of the time)."""
HEX_VALUES[np.frombuffer(b"0123456789", np.uint8)] = range(10)
HEX_VALUES[np.frombuffer(b"abcdef", np.uint8)] = range(10, 16)
HEX_VALUES[np.frombuffer(b"ABCDEF", np.uint8)] = range(10, 16)
_MAX_DIGITS = 18  # any 18-digit integer fits int64
_QUOTE, _COLON, _COMMA, _MINUS = 34, 58, 44, 45
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def same_bytes(x, i, y, j, size):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether ``x[i:i + size]`` and ``y[j:j + size]`` hold the same bytes."""
    for t in range(size):  # noqa: SIM110 - compiled: no generator expressions
        if x[i + t] != y[j + t]:
            return False
    return True


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _is_name(buf, a, b, f):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether the text ``buf[a:b]`` is name ``f`` of :data:`NAMES`."""
    return b - a == NAME_ENDS[f + 1] - NAME_ENDS[f] and same_bytes(
        buf, a, NAMES, NAME_ENDS[f], b - a
    )


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _name_of(buf, a, b, among):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Which of the names ``among[0]``, … before ``among[1]`` of :data:`NAMES` the text
    ``buf[a:b]`` is (0, 1, …), or -1."""
    for f in range(among[1] - among[0]):
        if _is_name(buf, a, b, among[0] + f):
            return f
    return -1


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _field_of(buf, a, b, among, expected):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`_name_of`, trying field ``expected`` first (the next one in the order encoders
    write them)."""
    if expected < among[1] - among[0] and _is_name(buf, a, b, among[0] + expected):
        return expected
    return _name_of(buf, a, b, among)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _string(buf, i, n):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The end (index of the closing quote) of the string whose opening quote is at ``i``, or
    -1: not a string, unterminated, or an escape in it. Control characters are the caller's
    to refuse (a name compared with the known ones, a hash with hex digits, has none)."""
    if i >= n or buf[i] != _QUOTE:
        return -1
    j = string_end(buf, i + 1, n)
    if j >= n or buf[j] != _QUOTE:
        return -1
    return j


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _text(buf, i, n):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """:func:`_string` for a value kept as text: no control character in it either."""
    j = _string(buf, i, n)
    for t in range(i + 1, j):
        if buf[t] < 32:
            return -1
    return j


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _integer(buf, i, n):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``(end, value)`` of the plain integer at ``i`` (``end`` -1: not one, see the module
    docstring); the byte after it is the caller's to check (a ``.`` or ``e`` is no separator)."""
    negative = i < n and buf[i] == _MINUS
    if negative:
        i += 1
    start = i
    v = np.int64(0)
    while i < n and 48 <= buf[i] <= 57 and i - start < _MAX_DIGITS + 1:
        v = v * 10 + np.int64(buf[i] - 48)
        i += 1
    digits = i - start
    if digits == 0 or digits > _MAX_DIGITS or (digits > 1 and buf[start] == 48):
        return -1, np.int64(0)
    if negative:
        if v == 0:  # -0
            return -1, np.int64(0)
        v = -v
    return i, v


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _hex_byte(buf, i):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The byte the two hex digits at ``i`` spell (:data:`HEX_VALUES`), or -1."""
    hi, lo = HEX_VALUES[buf[i]], HEX_VALUES[buf[i + 1]]
    return np.int64(-1) if (hi | lo) < 0 else np.int64(hi) * 16 + np.int64(lo)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _key(buf, i, n, e, hashes, cols):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse the key object at ``i`` into entry ``e``'s columns; its end, or -1."""
    if i >= n or buf[i] != _LBRACE:
        return -1
    cols[GROUP, e] = 0
    cols[SALT_AT, e] = cols[SALT_END, e] = 0
    seen = 0
    field = -1  # the field before (none yet)
    i = skip_space(buf, i + 1, n)
    while True:
        j = _string(buf, i, n)
        if j < 0:
            return -1
        field = _field_of(buf, i + 1, j, _KEY_FIELDS, field + 1)
        if field < 0 or seen & (1 << field):
            return -1
        seen |= 1 << field
        i = skip_space(buf, j + 1, n)
        if i >= n or buf[i] != _COLON:
            return -1
        i = skip_space(buf, i + 1, n)
        if field in (_RANK, _GROUP):
            i, v = _integer(buf, i, n)
            if i < 0:
                return -1
            cols[KV_RANK if field == _RANK else GROUP, e] = v
        else:
            j = _string(buf, i, n) if field == _HASH else _text(buf, i, n)
            if j < 0:
                return -1
            if field == _HASH:
                if j - i - 1 != 64:
                    return -1
                bad = np.int64(0)
                for t in range(32):
                    v = _hex_byte(buf, i + 1 + 2 * t)
                    bad |= v
                    hashes[e, t] = v
                if bad < 0:
                    return -1
            elif field == _MODEL:
                cols[MODEL_AT, e], cols[MODEL_END, e] = i + 1, j
            else:
                cols[SALT_AT, e], cols[SALT_END, e] = i + 1, j
            i = j + 1
        i = skip_space(buf, i, n)
        if i < n and buf[i] == _COMMA:
            i = skip_space(buf, i + 1, n)
            continue
        if i < n and buf[i] == _RBRACE and seen & 7 == 7:  # hash, model and rank given
            return i + 1
        return -1


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _entry(buf, i, n, e, hashes, cols, arena, k):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse the entry object at ``i`` (its ``{``) into row ``e``; ``(end, k)``: the index
    after its ``}`` (-1: given up) and the new fill of the arena."""
    cols[SIZE, e] = 0
    cols[OFFSET, e] = -1
    cols[TOKENS, e] = 0
    cols[START, e] = k
    seen = 0
    field = -1  # the field before (none yet)
    i = skip_space(buf, i + 1, n)
    while True:
        j = _string(buf, i, n)
        if j < 0:
            return -1, k
        field = _field_of(buf, i + 1, j, _ENTRY_FIELDS, field + 1)
        if field < 0 or seen & (1 << field):
            return -1, k
        seen |= 1 << field
        i = skip_space(buf, j + 1, n)
        if i >= n or buf[i] != _COLON:
            return -1, k
        i = skip_space(buf, i + 1, n)
        if field == _KEY:
            i = _key(buf, i, n, e, hashes, cols)
        elif field == _TOKENS:
            if i < n and buf[i] == _LBRACKET:
                end, filled = parse_array(buf, i, n, arena, k)
                if end >= 0:
                    cols[TOKENS, e] = filled - k
                    k = filled
                i = end
            elif i + 4 <= n and _is_name(buf, i, i + 4, _NULL_NAME):
                i += 4
            else:
                return -1, k
        else:
            i, v = _integer(buf, i, n)
            if v < (0 if field == _SIZE else UNKNOWN_OFFSET):  # (the per-entry path words why)
                return -1, k
            cols[SIZE if field == _SIZE else OFFSET, e] = v
        if i < 0:
            return -1, k
        i = skip_space(buf, i, n)
        if i < n and buf[i] == _COMMA:
            i = skip_space(buf, i + 1, n)
            continue
        if i < n and buf[i] == _RBRACE and seen & 1:  # the key given
            return i + 1, k
        return -1, k


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _same_text(buf, cols, at, end, e, f):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether the spans ``at``–``end`` of entries ``e`` and ``f`` hold one text."""
    a, b = cols[at, e], cols[at, f]
    size = cols[end, e] - a
    return size == cols[end, f] - b and same_bytes(buf, a, buf, b, size)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _same_shape(buf, cols, e, f):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Whether entries ``e`` and ``f`` have one key shape (model, rank, group, salt)."""
    return (
        cols[KV_RANK, e] == cols[KV_RANK, f]
        and cols[GROUP, e] == cols[GROUP, f]
        and _same_text(buf, cols, MODEL_AT, MODEL_END, e, f)
        and _same_text(buf, cols, SALT_AT, SALT_END, e, f)
    )


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def parse_entries(buf, i, n, e, hashes, cols, runs, arena, k):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse the entries array at ``i`` (its ``[``) into rows ``e``, ``e + 1``, …; returns
    ``(end, e, k)``: the index after its ``]`` (-1: given up, or more entries than rows), the
    next free row and the new fill of the arena. ``runs[r]`` gets the first row of run
    ``r`` (a run starts where the key shape differs from the row before)."""
    i = skip_space(buf, i + 1, n)
    if i < n and buf[i] == _RBRACKET:
        return i + 1, e, k
    while i < n:
        if e == cols.shape[1] or buf[i] != _LBRACE:
            return -1, e, k
        i, k = _entry(buf, i, n, e, hashes, cols, arena, k)
        if i < 0:
            return -1, e, k
        if e == 0:
            cols[RUN, e] = 0
            runs[0] = 0
        elif _same_shape(buf, cols, e, e - 1):
            cols[RUN, e] = cols[RUN, e - 1]
        else:
            cols[RUN, e] = cols[RUN, e - 1] + 1
            runs[cols[RUN, e]] = e
        e += 1
        i = skip_space(buf, i, n)
        if i < n and buf[i] == _COMMA:
            i = skip_space(buf, i + 1, n)
            continue
        if i < n and buf[i] == _RBRACKET:
            return i + 1, e, k
        return -1, e, k
    return -1, e, k
