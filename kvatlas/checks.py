"""Argument checks shared by every layer (bool is an int to Python, never to kvatlas)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard


def is_plain_int(value: object) -> TypeGuard[int]:
    """``True`` for an ``int`` that is not a ``bool`` (``True`` is not a chunk size or offset)."""
    return isinstance(value, int) and not isinstance(value, bool)


def refuse_big_endian(what: str, error: Callable[[str], Exception] = ImportError) -> None:
    """Raise ``error`` on a big-endian host: ``what`` reads words little-endian, the byte order
    of every target numba compiles for (x86-64, AArch64, ppc64le) and of the snapshot file."""
    if sys.byteorder != "little":
        raise error(f"{what} reads words little-endian: big-endian hosts are not supported")


def check_http_url(url: str, flag: str) -> str:
    """``url`` without a trailing slash, or ``ValueError`` naming ``flag`` when it is not an
    ``http(s)://host...`` URL (``127.0.0.1:9300`` would be retried forever as a path) or
    carries credentials (:func:`has_userinfo`; the message does not repeat them)."""
    from urllib.parse import urlsplit

    if has_userinfo(url):
        raise ValueError(
            f"{flag}: a URL must not carry user:password@ (it would show in logs, on /healthz "
            "and in the process list); kvatlas authenticates with bearer tokens from files"
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:9300)")
    return url.rstrip("/")


def has_userinfo(url: str) -> bool:
    """Whether ``url``'s authority has a ``user[:password]@`` part."""
    from urllib.parse import urlsplit

    try:
        return "@" in urlsplit(url).netloc
    except ValueError:  # (e.g. an unclosed IPv6 bracket: not a URL either)
        return False


def check_port(flag: str, port: int, lowest: int = 1) -> None:
    """``ValueError`` naming ``flag`` when ``port`` is outside [``lowest``, 65535] (a socket
    binds a larger one modulo 2^16: 70000 listened on 4464); ``lowest`` 0: the system picks."""
    if not lowest <= port <= 65535:
        raise ValueError(f"{flag} must be in [{lowest}, 65535], got {port}")


def bool_position(values: Sequence[object], ids: Any) -> int | None:
    """Index of the first bool (Python's or numpy's) in the list or tuple ``values``, given
    ``ids``, its 1-D integer array (an array built from a list takes ``True`` as the id 1).
    Only positions whose id is 0 or 1 are looked at (a bool is one of them): one vectorized
    comparison for a prompt without such ids, so the list path keeps its speed."""
    import numpy as np

    if ids.size == 0 or ids.min() > 1:
        return None
    small = np.flatnonzero(ids <= 1)
    if len(small) > 256:  # many 0/1 ids: every element's type, at C speed
        kinds = set(map(type, values))
        if bool not in kinds and np.bool_ not in kinds:
            return None
    return next((i for i in small.tolist() if isinstance(values[i], (bool, np.bool_))), None)


def uint32_token_bytes(token_ids: object) -> bytes:
    """Token ids as little-endian uint32 bytes (every wire's form of a prompt), refusing what
    does not fit — a negative or ≥ 2^32 id, a float, a bool, a string — with
    :class:`~kvatlas.errors.InvalidInput` naming the first one, never a wrap-around."""
    import numpy as np

    from kvatlas.errors import InvalidInput

    try:
        array = np.asarray(token_ids)
    except (OverflowError, ValueError) as exc:
        raise InvalidInput(f"token ids must be integers in [0, 2^32): {exc}") from None
    if array.size == 0:
        return b""
    if isinstance(token_ids, (list, tuple)) and array.ndim == 1 and array.dtype.kind in "iu":
        at = bool_position(token_ids, array)
        if at is not None:
            raise InvalidInput(f"token id {token_ids[at]!r} (position {at}) is not an integer")
    if array.dtype.kind == "u" and array.dtype.itemsize <= 4:  # in range by its type
        return np.ascontiguousarray(array, dtype="<u4").tobytes()
    if array.dtype.kind == "O":  # Python ints beyond int64, or mixed types
        values = array.ravel().tolist()
        bad = next((t for t in values if not is_plain_int(t) or not 0 <= t < 1 << 32), None)
        if bad is not None:
            raise InvalidInput(f"token id {bad!r} is not an integer in [0, 2^32)")
        array = np.asarray(values, dtype=np.int64)
    elif array.dtype.kind not in "iu":
        shown = array.ravel()[0].item()
        raise InvalidInput(f"token id {shown!r} is not an integer (ids are {array.dtype})")
    if array.min() < 0 or array.max() >= 1 << 32:
        bad = next(t for t in array.ravel().tolist() if not 0 <= t < 1 << 32)
        raise InvalidInput(f"token id {bad} is outside [0, 2^32)")
    return np.ascontiguousarray(array, dtype="<u4").tobytes()
