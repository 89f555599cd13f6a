"""Anchors: the few query positions where a stored content can start, found without a
fingerprint at every window.

A content's *anchor* is its leftmost least k-gram (:data:`K` ids) under a keyed 32-bit hash,
and that k-gram's offset in the content. A window of a query holds the same k-grams as the
content it equals, at the same distances, so its leftmost least k-gram is the content's anchor
shifted by the window's start. A query's candidates are therefore its *window minima* — the
distinct leftmost least k-grams of its windows, ≈ 2n / (chunk - K + 2) of them (≈ 260 in 32k
tokens) — each probed in a table of the contents by anchor hash: a content whose anchor hash
agrees is a candidate at ``query position - anchor offset``, compared id for id before it is
returned (``scan.py``). Recall is complete: a content equal to the window at ``o`` has its
anchor at a window minimum of ``o``. The hash is keyed by a per-index secret
(:func:`new_keys`), so no one can choose contents that share an anchor (they would make long
probe runs, never a wrong match). Ties (a repeated k-gram) go to the leftmost, in the content
and in the query alike.

The table holds content ids (``int32``, -1 empty; linear probing, never deleted from: a
removed content's slot stays until the next rebuild, and is skipped because its content is
gone or now has another anchor) and beside each slot a byte of the anchor's hash (``tags``);
each content's anchor is in ``c_anchor`` by id, as its hash's bits above :func:`offset_bits`
and its offset below them. What is kept and homed by is the least hash *spread*
(:func:`_spread`): the least of ≈250 hashes has its top bits clear.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.fingerprints import load_ids, tagged
from kvatlas.directory.blend.kernels.pointers import helper, i64_ptr, inline, jit, prefetch
from kvatlas.kernel_twins import gil_twins, releasing_twin

K = 4
"""Ids in a k-gram: short enough that a content has chunk - K + 1 of them to take the least
of, long enough that ids repeated in a query (a run of one token) rarely repeat k-grams. A
chunk shorter than this (tests' tiny chunks) is one k-gram, padded with zeros
(:func:`kgram_size`)."""
_EMPTY = -1


def kgram_size(chunk: int) -> int:
    """The k-gram of an index of ``chunk``-id contents: :data:`K` ids, or the whole chunk."""
    return min(K, chunk)


def offset_bits(chunk: int) -> int:
    """Bits of a stored anchor that hold its offset (``0 .. chunk - k``); the hash's bits
    above them are kept."""
    return max(1, (chunk - kgram_size(chunk)).bit_length())


def new_keys() -> npt.NDArray[np.uint32]:
    """A fresh secret: :data:`K` odd 32-bit multipliers."""
    return np.frombuffer(os.urandom(4 * K), np.uint32) | np.uint32(1)


@inline
def _hash(a: Any, b: Any, c: Any, d: Any, keys: Any) -> Any:
    """The keyed hash of the k-gram ``a b c d``: a keyed sum, then murmur3's finalizer, all
    mod 2^32 (each step cast back: numba widens integer arithmetic to 64 bits)."""
    u = np.uint32
    h = u(u(a * keys[0]) + u(b * keys[1]) + u(c * keys[2]) + u(d * keys[3]))
    h = u(h ^ (h >> u(16)))
    h = u(h * u(0x85EBCA6B))
    h = u(h ^ (h >> u(13)))
    h = u(h * u(0xC2B2AE35))
    return u(h ^ (h >> u(16)))


@inline
def _spread(h: Any) -> Any:
    """A least hash spread over all 32 bits (a bijection: equal spreads, equal hashes). The
    least of ≈250 hashes has its top bits clear; what a table keeps and homes by must not."""
    u = np.uint32
    g = u(h * u(0x9E3779B1))
    return u(g ^ (g >> u(16)))


@helper
def _short(ids: Any, at: Any, k: Any, keys: Any) -> Any:
    """The hash of the ``k < K`` ids at ``at``, padded with zeros."""
    zero = np.uint32(0)
    b = ids[at + 1] if k > 1 else zero
    c = ids[at + 2] if k > 2 else zero
    return _hash(ids[at], b, c, zero, keys)


@jit
def query_kgrams(q: Any, k: Any, keys: Any, out: Any) -> Any:
    """``out[i]`` = the hash of the ``k``-gram at ``i`` of ``q``, for every ``i`` with a
    whole k-gram; returns their number. Slices indexed from 0: the loop compiles to SIMD."""
    n = q.shape[0] - k + 1
    if n <= 0:
        return 0
    dst = out[0:n]
    if k == K:
        q0, q1, q2, q3 = q[0:n], q[1 : n + 1], q[2 : n + 2], q[3 : n + 3]
        for i in range(n):
            dst[i] = _hash(q0[i], q1[i], q2[i], q3[i], keys)
    else:
        for i in range(n):
            dst[i] = _short(q, i, k, keys)
    return n


@inline
def _leftmost_least(v: Any) -> Any:
    """The first index of ``v``'s least value (the value in SIMD, then its place)."""
    m = v[0]
    for i in range(1, v.shape[0]):
        x = v[i]
        m = x if x < m else m
    return _first_at_most(v, m)


@inline
def _first_at_most(v: Any, m: Any) -> Any:
    """The first index of ``v`` holding a value not above ``m``, else ``len(v)``."""
    if m == np.uint32(0xFFFFFFFF):
        return 0
    return _first_below(v, np.uint32(m + np.uint32(1)))


@inline
def _first_below(v: Any, m: Any) -> Any:
    """The first index of ``v`` holding a value below ``m``, else ``len(v)``; 16 at a time."""
    n = v.shape[0]
    i = 0
    while i + 16 <= n:
        below = 0
        for j in range(16):
            below |= v[i + j] < m
        if below:
            break
        i += 16
    while i < n:
        if v[i] < m:
            return i
        i += 1
    return n


@inline
def _first_other(v: Any, m: Any) -> Any:
    """The first index of ``v`` holding a value other than ``m``, else ``len(v)``; 16 at a
    time."""
    n = v.shape[0]
    i = 0
    while i + 16 <= n:
        other = 0
        for j in range(16):
            other |= v[i + j] != m
        if other:
            break
        i += 16
    while i < n:
        if v[i] != m:
            return i
        i += 1
    return n


_NEAR = 32
"""How far into a window whose least left :func:`window_minima` looks for an equal k-gram
before it searches the whole window: far enough for a run or a repeated phrase, short enough
that random ids (no equal) waste little."""


@jit
def window_minima(kgrams: Any, n: Any, width: Any, out: Any) -> Any:
    """The positions of the distinct leftmost least of every ``width`` consecutive
    ``kgrams[:n]``, ascending (a window's least moves only right as the window does), into
    ``out``; returns how many. A window's least is kept until a smaller k-gram enters
    (an equal one does not: the left one stays the leftmost) or it leaves; then an equal one
    among the window's first :data:`_NEAR` is the next least, else the window is searched
    again. A run of one k-gram from a window's start gives each next window its first, until
    the run ends or a smaller one enters: those windows are filled at once (searched for 16
    at a time)."""
    last = n - width  # the last window's start
    if last < 0:
        return 0
    at = _leftmost_least(kgrams[0:width])
    m = kgrams[at]
    out[0] = at
    k = 1
    o = 1
    while o <= last:
        end = min(at + 1, last + 1)  # windows [o, end) still hold the least at ``at``
        j = o + width - 1 + _first_below(kgrams[o + width - 1 : end + width - 1], m)
        if j < end + width - 1:  # a smaller one enters at j: the least of windows from j-w+1
            at = j
            o = j - width + 2
        elif end <= last:  # it leaves: the window at ``end`` searched again, unless it
            near = min(width, _NEAR)  # holds an equal one near its start (a run, a phrase)
            at = end + _first_at_most(kgrams[end : end + near], m)
            if at == end + near or kgrams[end + width - 1] < m:
                at = end + _leftmost_least(kgrams[end : end + width])
            o = end + 1
            if at == end and at < last:  # a run of one k-gram from the window's start: each
                v = kgrams[at]  # next window's least is its first, until the run ends or a
                e = at + 1 + _first_other(kgrams[at + 1 : last + 1], v)  # smaller one enters
                e = at + width + _first_below(kgrams[at + width : e + width - 1], v) - width + 1
                for i in range(e - 1 - at):  # windows at .. e - 2 (e - 1: below)
                    out[k + i] = at + i
                k += e - 1 - at
                at = e - 1
                o = e
        else:
            break
        m = kgrams[at]
        out[k] = at
        k += 1
    return k


@jit
def content_anchor(row: Any, chunk: Any, k: Any, keys: Any, hashes: Any) -> Any:
    """The anchor of the content whose ``chunk`` ids are ``row``'s first, taken as a query's
    window least is (the same hashes, the same leftmost rule; ``hashes``: room for them):
    (its spread hash, its offset)."""
    n = query_kgrams(row[:chunk], k, keys, hashes)
    at = _leftmost_least(hashes[:n])
    return _spread(hashes[at]), np.uint32(at)


@gil_twins()
def query_minima(q: Any, chunk: Any, keys: Any, kgrams: Any, minima: Any) -> Any:
    """The hashes of ``q``'s k-grams into ``kgrams`` and the positions of the minima of its
    windows of ``chunk`` ids into ``minima`` (both as long as ``q``): what a match probes
    (:func:`anchor_candidates`); returns how many minima there are."""
    k = min(K, chunk)
    n = query_kgrams(q, k, keys, kgrams)
    return window_minima(kgrams, n, chunk - k + 1, minima)


query_minima_releasing = releasing_twin(query_minima)
""":func:`query_minima`, the GIL released (a long query's: ``kvatlas/kernel_twins.py``)."""


@inline
def _home(h: Any, bits: Any, mask: Any) -> Any:
    """A spread hash's slot: its bits above the offset's."""
    return np.int64(h >> np.uint32(bits)) & mask


@helper
def _insert(slots: Any, tags: Any, spread: Any, bits: Any, cid: Any) -> None:
    mask = slots.shape[0] - 1
    s = _home(spread, bits, mask)
    while slots[s] != _EMPTY:
        s = (s + 1) & mask
    slots[s] = cid
    tags[s] = np.uint8(spread & np.uint32(0xFF))


@gil_twins()
def anchor_contents(
    cids: Any,
    c_addr: Any,
    chunk: Any,
    keys: Any,
    bits: Any,
    c_anchor: Any,
    slots: Any,
    tags: Any,
    row: Any,
    hashes: Any,
) -> Any:
    """Anchor the live contents among ``cids`` (``c_addr`` not 0): each one's anchor into
    ``c_anchor`` (its spread hash's bits above ``bits``, its offset below them), its id
    into ``slots`` and its spread hash's low byte into ``tags`` beside it (a probe reads
    ``c_anchor`` only where the tag agrees); returns how many were inserted."""
    n = 0
    k = min(K, chunk)
    low = np.uint32((1 << bits) - 1)
    for i in range(cids.shape[0]):
        cid = cids[i]
        addr = c_addr[cid]
        if addr != 0:
            load_ids(row, addr, chunk)
            spread, offset = content_anchor(row, chunk, k, keys, hashes)
            c_anchor[cid] = (spread & ~low) | offset
            _insert(slots, tags, spread, bits, cid)
            n += 1
    return n


@gil_twins()
def content_anchors(
    handles: Any, data_off: Any, token_bytes: Any, chunk: Any, keys: Any, out: Any
) -> None:
    """``out[i]`` = the anchor of the ``chunk`` ids of array ``i`` (addressed as
    ``fingerprints.content_fingerprints`` takes them): its spread hash in the high 32 bits,
    its offset in the low ones (what a snapshot saves: :func:`adopt_anchors` takes it)."""
    k = min(K, chunk)
    row = np.empty(chunk, np.uint32)
    hashes = np.empty(chunk, np.uint32)
    for i in range(handles.shape[0]):
        addr = handles[i]
        if data_off >= 0:
            addr = i64_ptr(addr + data_off)[0]  # type: ignore[call-arg]
        load_ids(row, tagged(addr, token_bytes[i]), chunk)
        spread, offset = content_anchor(row, chunk, k, keys, hashes)
        out[i] = (np.uint64(spread) << np.uint64(32)) | np.uint64(offset)


content_anchors_releasing = releasing_twin(content_anchors)
""":func:`content_anchors`, the GIL released (a snapshot writer's: ≈0.3 µs a content)."""


@gil_twins()
def adopt_anchors(saved: Any, bits: Any, c_anchor: Any, slots: Any, tags: Any) -> Any:
    """Contents ``0 .. len(saved)`` anchored as ``saved`` says (:func:`content_anchors`'
    values, checked by the caller), into ``c_anchor`` and the empty table ``slots`` and
    ``tags``; returns how many were inserted. An offset past ``bits`` is cut to them (a
    wrong anchor hides its content, never makes a wrong match: candidates are compared)."""
    low = np.uint32((1 << bits) - 1)
    for cid in range(saved.shape[0]):
        spread = np.uint32(saved[cid] >> np.uint64(32))
        c_anchor[cid] = (spread & ~low) | (np.uint32(saved[cid] & np.uint64(0xFFFFFFFF)) & low)
        _insert(slots, tags, spread, bits, cid)
    return saved.shape[0]


adopt_anchors_releasing = releasing_twin(adopt_anchors)
""":func:`adopt_anchors`, the GIL released (a restore's, ≈30 ms at 10^6 contents)."""

anchor_contents_releasing = releasing_twin(anchor_contents)
""":func:`anchor_contents`, the GIL released (a rebuild's, or the first lookup's after a
restore from a snapshot without anchors: ≈0.3 s at 10^6 contents, during which the event loop
goes on)."""


@jit
def anchor_candidates(
    kgrams: Any,
    minima: Any,
    n_minima: Any,
    start: Any,
    stop: Any,
    stride: Any,
    chunk: Any,
    bits: Any,
    slots: Any,
    tags: Any,
    c_anchor: Any,
    c_addr: Any,
) -> Any:
    """(window starts, content ids) of the contents whose anchor hash is the hash at one of
    the query's window minima (positions ``minima[:n_minima]``) and which would start at a
    probed window in ``[start, stop)``, by window start (a content found twice, through a
    stale slot, is listed twice). Consecutive minima of one hash (a run of one k-gram in
    the query, a repeated phrase) are probed once; the table's slots are requested for all
    probes first."""
    mask = slots.shape[0] - 1
    k = min(K, chunk)
    a0 = np.searchsorted(minima[:n_minima], start)
    a1 = np.searchsorted(minima[:n_minima], stop + chunk - k)  # (a window's least: <= o + c - k)
    spreads = np.empty(max(a1 - a0, 0), np.uint32)  # each probe's spread hash, and
    firsts = np.empty(max(a1 - a0, 0) + 1, np.int64)  # its first minimum
    r = 0
    h = np.uint32(0)
    for a in range(a0, a1):
        if r == 0 or kgrams[minima[a]] != h:  # (equal hashes, equal spreads)
            h = kgrams[minima[a]]
            spread = _spread(h)
            spreads[r] = spread
            firsts[r] = a
            r += 1
            prefetch(slots, _home(spread, bits, mask))  # type: ignore[call-arg]
    firsts[r] = a1
    probes = spreads[:r], firsts[: r + 1]
    n = _walk(minima, *probes, start, stop, stride, bits, slots, tags, c_anchor, c_addr,
              np.empty(0, np.int64), np.empty(0, np.int64))  # fmt: skip
    pos = np.empty(n, np.int64)  # (sized by a first walk: an array grown in the loop would be
    cid_of = np.empty(n, np.int64)  # reference-counted on every iteration)
    if n == 0:
        return pos, cid_of
    _walk(minima, *probes, start, stop, stride, bits, slots, tags, c_anchor, c_addr, pos, cid_of)
    order = np.argsort(pos, kind="mergesort")
    return pos[order], cid_of[order]


@helper
def _walk(
    minima: Any,
    spreads: Any,
    firsts: Any,
    start: Any,
    stop: Any,
    stride: Any,
    bits: Any,
    slots: Any,
    tags: Any,
    c_anchor: Any,
    c_addr: Any,
    pos: Any,
    cid_of: Any,
) -> Any:
    """The candidates of :func:`anchor_candidates` (probe ``r``: spread hash ``spreads[r]``,
    of the minima ``minima[firsts[r]:firsts[r + 1]]``), into ``pos`` and ``cid_of`` when
    they are not empty; returns how many there are."""
    mask = slots.shape[0] - 1
    low = np.uint32((1 << bits) - 1)
    fill = pos.shape[0] > 0
    n = 0
    for r in range(spreads.shape[0]):
        spread = spreads[r]
        high = spread & ~low
        tag = np.uint8(spread & np.uint32(0xFF))
        s = _home(spread, bits, mask)
        while slots[s] != _EMPTY:
            cid = slots[s]
            same = tags[s] == tag
            s = (s + 1) & mask
            if not same:
                continue
            anchor = c_anchor[cid]
            if anchor & ~low != high or c_addr[cid] == 0:
                continue
            offset = np.int64(anchor & low)
            for a in range(firsts[r], firsts[r + 1]):
                o = minima[a] - offset
                if o < start or o >= stop or (stride != 1 and o % stride != 0):
                    continue
                if fill:
                    pos[n] = o
                    cid_of[n] = cid
                n += 1
    return n
