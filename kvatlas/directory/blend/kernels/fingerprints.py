"""A content's ids read from its stored form, and content fingerprints outside a write.

The write kernel fingerprints each added content from its ids (``writes.py``); a snapshot
writer fingerprints the contents it saves (the column a restore takes instead of reading and
hashing every id again: docs/directory.md, "Snapshots"). Both read the ids through
:func:`load_ids`, so a content's fingerprint is one function of its ids whatever its form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.layout import ADDRESS_BITS, TOKENS_PLANES, TOKENS_U16
from kvatlas.directory.blend.kernels.modhash import fingerprint_at, power_table
from kvatlas.directory.blend.kernels.planes import planes_load
from kvatlas.directory.blend.kernels.pointers import i64_ptr, inline, jit, u16_ptr, u32_ptr
from kvatlas.kernel_twins import gil_twins, releasing_twin


@inline
def tagged(addr: Any, token_bytes: Any) -> Any:
    """A content's token address with the tag of its form (``layout.py``; ``token_bytes``:
    2 for ``uint16``, 1 for the planes form, 4 for ``uint32``)."""
    if token_bytes == 2:
        return addr | TOKENS_U16
    if token_bytes == 1:
        return addr | TOKENS_PLANES
    return addr


@inline
def load_ids(row: Any, addr: Any, chunk: Any) -> None:
    """``row[:chunk]`` (``uint32``) = the ids at the tagged token address ``addr``."""
    if addr & TOKENS_U16:
        _load(row, u16_ptr(addr & ADDRESS_BITS), chunk)  # type: ignore[call-arg]
    elif addr & TOKENS_PLANES:
        planes_load(row, addr & ADDRESS_BITS, chunk)
    else:
        _load(row, u32_ptr(addr), chunk)  # type: ignore[call-arg]


@jit
def _load(out: Any, p: Any, chunk: Any) -> None:
    """``out[:chunk]`` = the ids at the typed pointer ``p`` (compiled once per width)."""
    for k in range(chunk):
        out[k] = p[k]


@gil_twins()
def content_fingerprints(
    handles: Any, data_off: Any, token_bytes: Any, chunk: Any, base: Any, fmask: Any, out: Any
) -> None:
    """``out[i]`` = the fingerprint of the ``chunk`` ids of array ``i`` (``handles[i]``: its
    ``id``, the data pointer read at ``data_off``, or with ``data_off < 0`` the data address
    itself; ``token_bytes[i]``: its form, as :func:`tagged` takes it)."""
    row = np.empty(chunk, np.uint32)
    powers = np.empty((2, chunk), np.uint64)
    power_table(base, chunk, powers)
    for i in range(handles.shape[0]):
        addr = handles[i]
        if data_off >= 0:
            addr = i64_ptr(addr + data_off)[0]  # type: ignore[call-arg]
        load_ids(row, tagged(addr, token_bytes[i]), chunk)
        out[i] = fingerprint_at(row, 0, chunk, powers, fmask)


RELEASE_CONTENTS = 1024
"""Calls of at least this many contents (≈0.3 ms) release the GIL (``kernel_twins.py``)."""

content_fingerprints_releasing = releasing_twin(content_fingerprints)
""":func:`content_fingerprints`, the GIL released for the call."""
