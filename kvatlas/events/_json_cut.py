"""Cut the entries out of a JSON events body in one compiled pass.

Entries are most of a JSON body, and decoding them with msgspec made several Python objects
each (the entry, its key, strings, a ``Raw`` token list) only for the columns to be built from
them. :func:`cut_entries` reads the body once: it follows the body's structure (strings,
objects, arrays), parses each batch's ``entries`` array where it lies into columns
(``_json_entries.parse_entries``: token ids into one arena by ``_json_tokens.parse_array``),
and copies everything else into a smaller body in which each such array is ``[]``. msgspec
then decodes only that (the batch headers).

Why this accepts and refuses exactly what the per-entry path does: the small body differs
from the original only where an entries array stood that the entry parser took (only in a
form msgspec decodes, see ``_json_entries``), at a position the scanner reached by following
a prefix of the body; a value replaced by another value leaves the rest of the text as valid
or as broken as it was, so msgspec accepts the small body if and only if it accepts the
original, with the same fields but the entries. Anything the scanner is not sure of gives up
(``FALLBACK``) and the caller decodes the per-entry way, which also words every error: an
entry the entry parser does not take, any escape in a key of the root or a batch (an
escaped key may decode to one of the names followed), a key seen twice in one object of
those, nesting deeper than ``MAX_DEPTH``, an unterminated string or container, more entry
or batch objects than a valid body of its size can hold.

This module imports numba: ``json_codec`` imports it on first use only. numba keys its cache
of :func:`_cut` by this file alone, though it compiles in ``_json_entries``, ``_json_tokens``
and ``_json_words``: kvatlas keys the cache directory by every source
(``kvatlas/kernel_cache.py``), so a change to any starts a fresh one, unless
``NUMBA_CACHE_DIR`` was set by hand (then clear it).
"""

from __future__ import annotations

import numba
import numpy as np

from kvatlas.events._cut_types import COLUMNS, RUN, START, TOKENS, CutBody
from kvatlas.events._json_entries import parse_entries, same_bytes
from kvatlas.events._json_tokens import RELEASE_BYTES, skip_space, string_end
from kvatlas.kernel_twins import gil_twins, releasing_twin

OK, FALLBACK = 0, 1
MAX_DEPTH = 64
# the role of a container, by where it is: only these are followed
_OTHER, _ROOT, _BATCHES, _BATCH = 0, 1, 2, 3
# keys that matter, by the role of their object
_NO_KEY, _KEY_BATCHES, _KEY_ENTRIES = 0, 1, 2
_BATCHES_NAME = np.frombuffer(b"batches", np.uint8)
_ENTRIES_NAME = np.frombuffer(b"entries", np.uint8)
_QUOTE, _BACKSLASH, _COLON, _COMMA = 34, 92, 58, 44
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93
ENTRY_BYTES = 120
"""Fewer bytes than any entry the entry parser takes (a key with 64 hex digits, a model name
and a rank: 121 bytes at least): bounds the rows a body of ``n`` bytes can fill, and its
batches (a valid batch header is longer). A body with more gives up (the per-entry path)."""


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _is(buf, a, b, name):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Whether ``buf[a:b]`` is ``name``."""
    return b - a == len(name) and same_bytes(buf, a, name, 0, b - a)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _key_of(buf, a, b, role):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Which followed key ``buf[a:b]`` (a key's text, no quotes) is in an object of ``role``."""
    if role == _ROOT and _is(buf, a, b, _BATCHES_NAME):
        return _KEY_BATCHES
    if role == _BATCH and _is(buf, a, b, _ENTRIES_NAME):
        return _KEY_ENTRIES
    return _NO_KEY


@gil_twins(boundscheck=False)
def _cut(buf, out, arena, counts, hashes, cols, runs):  # type: ignore[no-untyped-def]  # pragma: no cover
    """See :func:`cut_entries`; returns ``(status, out length, entries, batches, runs)``."""
    n = len(buf)
    roles = np.zeros(MAX_DEPTH, np.int64)
    objects = np.zeros(MAX_DEPTH, np.bool_)
    seen = np.zeros(MAX_DEPTH, np.int64)  # per open object: the followed keys met (bits)
    depth = 0
    i = o = k = 0
    n_entries = n_batches = 0
    expect_key = False
    key = _NO_KEY
    while i < n:
        c = buf[i]
        if c == _QUOTE:
            j = string_end(buf, i + 1, n)
            escaped = False
            while j < n and buf[j] != _QUOTE:  # a backslash: skip it and what it escapes
                escaped = True
                j = string_end(buf, j + 2, n)
            if j >= n:
                return FALLBACK, 0, 0, 0, 0
            if expect_key:
                role = roles[depth - 1]
                if role in (_ROOT, _BATCH):
                    if escaped:
                        return FALLBACK, 0, 0, 0, 0
                    key = _key_of(buf, i + 1, j, role)
                    if key != _NO_KEY:
                        if seen[depth - 1] & (1 << key):
                            return FALLBACK, 0, 0, 0, 0
                        seen[depth - 1] |= 1 << key
                expect_key = False
            out[o : o + j + 1 - i] = buf[i : j + 1]
            o += j + 1 - i
            i = j + 1
            continue
        if c == _COLON:
            out[o] = c
            o += 1
            j = skip_space(buf, i + 1, n)
            for t in range(i + 1, j):
                out[o] = buf[t]
                o += 1
            i = j
            if key == _KEY_ENTRIES and i < n and buf[i] == _LBRACKET:
                key = _NO_KEY
                end, e, k = parse_entries(buf, i, n, n_entries, hashes, cols, runs, arena, k)
                if end < 0:
                    return FALLBACK, 0, 0, 0, 0
                counts[n_batches - 1] = e - n_entries
                n_entries = e
                out[o] = _LBRACKET
                out[o + 1] = _RBRACKET
                o += 2
                i = end
            continue
        if c in (_LBRACE, _LBRACKET):
            if depth == MAX_DEPTH:
                return FALLBACK, 0, 0, 0, 0
            role = _OTHER
            if depth == 0:
                if c == _LBRACE:
                    role = _ROOT
            elif objects[depth - 1]:
                if c == _LBRACKET and key == _KEY_BATCHES:
                    role = _BATCHES
            elif c == _LBRACE and roles[depth - 1] == _BATCHES:
                if n_batches == len(counts):
                    return FALLBACK, 0, 0, 0, 0
                role = _BATCH
                counts[n_batches] = 0
                n_batches += 1
            roles[depth] = role
            objects[depth] = c == _LBRACE
            seen[depth] = 0
            depth += 1
            expect_key = c == _LBRACE
            key = _NO_KEY
        elif c in (_RBRACE, _RBRACKET):
            if depth == 0:
                return FALLBACK, 0, 0, 0, 0
            depth -= 1
            expect_key = False
            key = _NO_KEY
        elif c == _COMMA:
            expect_key = depth > 0 and objects[depth - 1]
            key = _NO_KEY
        out[o] = c
        o += 1
        i += 1
    if depth != 0:  # unbalanced: broken, the Raw path words the error
        return FALLBACK, 0, 0, 0, 0
    return OK, o, n_entries, n_batches, 0 if n_entries == 0 else cols[RUN, n_entries - 1] + 1


_cut_releasing = releasing_twin(_cut)
""":func:`_cut`, the GIL released for the call (a large body: ``RELEASE_BYTES``)."""


def cut_entries(body: bytes) -> CutBody | None:
    """The body with every batch's ``entries`` array replaced by ``[]`` and the entries as
    columns (:class:`CutBody`); ``None`` when the caller must decode the body the per-entry
    way (see the module docstring)."""
    buf = np.frombuffer(body, np.uint8)
    n = len(buf)
    out = np.empty(n, np.uint8)  # "[]" is never longer than what it replaces
    arena = np.empty(n // 2 + 1, np.uint32)  # a token needs >= 2 bytes ("1,")
    # more entries or batches than a valid body of n bytes holds: refused here (FALLBACK)
    rows = n // ENTRY_BYTES + 16
    counts = np.empty(rows, np.int64)
    hashes = np.empty((rows, 32), np.uint8)
    cols = np.empty((COLUMNS, rows), np.int64)
    runs = np.empty(rows, np.int64)
    cut = _cut_releasing if n >= RELEASE_BYTES else _cut
    status, m, n_entries, n_batches, n_runs = cut(buf, out, arena, counts, hashes, cols, runs)
    if status != OK:
        return None
    # The columns outlive the cut (until the caller applies them, maybe beside other bodies'):
    # the arena, sized for ids of one digit, shrunk in place to the ids there are (a 1.8 MB
    # body of 1,024 chunks: 3.6 MB to 1 MB, no copy), the integers copied out of their
    # matrix, sized for the smallest entries (1.3 MB for 90 KB).
    ids = int(cols[START, n_entries - 1] + cols[TOKENS, n_entries - 1]) if n_entries else 0
    try:
        arena.resize(ids)  # in place (its only reference is this function's)
    except ValueError:  # referenced elsewhere (numba's compiling call keeps its arguments)
        arena = arena[:ids].copy()
    small, ints = out[:m], cols[:, :n_entries].copy()
    return CutBody(small, arena, counts[:n_batches], hashes[:n_entries], ints, runs[:n_runs])
