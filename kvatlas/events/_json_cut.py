"""Cut the ``token_ids`` arrays out of a JSON events body in one compiled pass.

Token lists are most of a JSON body. Handing them to msgspec as ``Raw`` (so that it scans
them) and parsing them again afterwards read them twice; :func:`cut_token_lists` reads the
body once: it follows the body's structure (strings, objects, arrays), parses each entry's
``token_ids`` array where it lies (``_json_tokens.parse_array``, the same rules) into one
arena, and copies everything else into a smaller body in which each such array is ``[]``.
msgspec then decodes only that (keys, sizes, offsets, headers).

Why this accepts and refuses exactly what the ``Raw`` path does: the small body differs from
the original only where a valid integer array stood, at a position the scanner reached by
following a prefix of the body; a value replaced by another value leaves the rest of the
text as valid or as broken as it was, so msgspec accepts the small body if and only if it
accepts the original, with the same fields but ``token_ids``. Anything the scanner is not
sure of gives up (``FALLBACK``) and the caller takes the ``Raw`` path, which also words every
error: a ``token_ids`` value that is not an integer array or ``null``, any escape in a key of
the root, a batch or an entry (an escaped key may decode to one of the names followed), a key
seen twice in one object of those, nesting deeper than ``MAX_DEPTH``, an unterminated string or container,
more entry or batch objects than a valid body of its size can hold.

This module imports numba: ``json_codec`` imports it on first use only. numba's on-disk cache
of :func:`_cut` is keyed by this file alone: after a change to ``_json_tokens.parse_array``,
which it compiles in, clear ``__pycache__/_json_cut*.nb?`` (a fresh checkout has none).
"""

from __future__ import annotations

import numba
import numpy as np

from kvatlas.events._cut_types import CutTokenLists
from kvatlas.events._json_tokens import RELEASE_BYTES, parse_array, skip_space, string_end
from kvatlas.kernel_twins import gil_twins, releasing_twin

OK, FALLBACK = 0, 1
MAX_DEPTH = 64
# the role of a container, by where it is: only these are followed
_OTHER, _ROOT, _BATCHES, _BATCH, _ENTRIES, _ENTRY = 0, 1, 2, 3, 4, 5
# keys that matter, by the role of their object
_NO_KEY, _KEY_BATCHES, _KEY_ENTRIES, _KEY_TOKENS = 0, 1, 2, 3
_BATCHES_NAME = np.frombuffer(b"batches", np.uint8)
_ENTRIES_NAME = np.frombuffer(b"entries", np.uint8)
_TOKENS_NAME = np.frombuffer(b"token_ids", np.uint8)
_QUOTE, _BACKSLASH, _COLON, _COMMA = 34, 92, 58, 44
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _is(buf, a, b, name):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Whether ``buf[a:b]`` is ``name``."""
    if b - a != len(name):
        return False
    for t in range(len(name)):  # noqa: SIM110 - compiled: no generator expressions
        if buf[a + t] != name[t]:
            return False
    return True


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _key_of(buf, a, b, role, names):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Which followed key ``buf[a:b]`` (a key's text, no quotes) is in an object of ``role``."""
    if role == _ROOT and _is(buf, a, b, names[0]):
        return _KEY_BATCHES
    if role == _BATCH and _is(buf, a, b, names[1]):
        return _KEY_ENTRIES
    if role == _ENTRY and _is(buf, a, b, names[2]):
        return _KEY_TOKENS
    return _NO_KEY


@gil_twins(boundscheck=False)
def _cut(buf, out, arena, lengths, counts, names):  # type: ignore[no-untyped-def]  # pragma: no cover
    """See :func:`cut_token_lists`; returns ``(status, out length, entries, batches)``."""
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
                return FALLBACK, 0, 0, 0
            if expect_key:
                role = roles[depth - 1]
                if role in (_ROOT, _BATCH, _ENTRY):
                    if escaped:
                        return FALLBACK, 0, 0, 0
                    key = _key_of(buf, i + 1, j, role, names)
                    if key != _NO_KEY:
                        if seen[depth - 1] & (1 << key):
                            return FALLBACK, 0, 0, 0
                        seen[depth - 1] |= 1 << key
                expect_key = False
            for t in range(i, j + 1):
                out[o] = buf[t]
                o += 1
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
            if key == _KEY_TOKENS:
                key = _NO_KEY
                if i < n and buf[i] == _LBRACKET:
                    end, filled = parse_array(buf, i, n, arena, k)
                    if end < 0:
                        return FALLBACK, 0, 0, 0
                    lengths[n_entries - 1] = filled - k
                    k = filled
                    out[o] = _LBRACKET
                    out[o + 1] = _RBRACKET
                    o += 2
                    i = end
                elif not (i + 4 <= n and _is(buf, i, i + 4, names[3])):  # null: no tokens
                    return FALLBACK, 0, 0, 0
            continue
        if c in (_LBRACE, _LBRACKET):
            if depth == MAX_DEPTH:
                return FALLBACK, 0, 0, 0
            role = _OTHER
            if depth == 0:
                if c == _LBRACE:
                    role = _ROOT
            elif objects[depth - 1]:
                if c == _LBRACKET and key == _KEY_BATCHES:
                    role = _BATCHES
                elif c == _LBRACKET and key == _KEY_ENTRIES:
                    role = _ENTRIES
            elif c == _LBRACE and roles[depth - 1] == _BATCHES:
                if n_batches == len(counts):
                    return FALLBACK, 0, 0, 0
                role = _BATCH
                counts[n_batches] = 0
                n_batches += 1
            elif c == _LBRACE and roles[depth - 1] == _ENTRIES:
                if n_entries == len(lengths):
                    return FALLBACK, 0, 0, 0
                role = _ENTRY
                lengths[n_entries] = 0
                n_entries += 1
                counts[n_batches - 1] += 1
            roles[depth] = role
            objects[depth] = c == _LBRACE
            seen[depth] = 0
            depth += 1
            expect_key = c == _LBRACE
            key = _NO_KEY
        elif c in (_RBRACE, _RBRACKET):
            if depth == 0:
                return FALLBACK, 0, 0, 0
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
        return FALLBACK, 0, 0, 0
    return OK, o, n_entries, n_batches


_cut_releasing = releasing_twin(_cut)
""":func:`_cut`, the GIL released for the call (a large body: ``RELEASE_BYTES``)."""

_NAMES = (_BATCHES_NAME, _ENTRIES_NAME, _TOKENS_NAME, np.frombuffer(b"null", np.uint8))


def cut_token_lists(
    body: bytes,
) -> CutTokenLists | None:
    """``(small body, arena, lengths, counts)``: the body with every entry's ``token_ids``
    array replaced by ``[]``, the arrays' ids one after the other in the arena, each entry
    object's count of ids (in body order; 0: absent, ``null`` or empty) and each batch
    object's count of entry objects; ``None`` when the caller must take the ``Raw`` path
    (see the module docstring)."""
    buf = np.frombuffer(body, np.uint8)
    n = len(buf)
    out = np.empty(n, np.uint8)  # "[]" is never longer than what it replaces
    arena = np.empty(n // 2 + 1, np.uint32)  # a token needs >= 2 bytes ("1,")
    # a valid entry is > 64 bytes (its key alone), a batch more: more objects than that
    # are refused here (FALLBACK), the Raw path decides
    lengths = np.empty(n // 64 + 16, np.int64)
    counts = np.empty(n // 64 + 16, np.int64)
    cut = _cut_releasing if n >= RELEASE_BYTES else _cut
    status, m, n_entries, n_batches = cut(buf, out, arena, lengths, counts, _NAMES)
    if status != OK:
        return None
    return out[:m], arena, lengths[:n_entries], counts[:n_batches]
