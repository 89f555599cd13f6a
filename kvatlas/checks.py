"""Argument checks shared by every layer (bool is an int to Python, never to kvatlas)."""

from __future__ import annotations

from typing import TypeGuard


def is_plain_int(value: object) -> TypeGuard[int]:
    """``True`` for an ``int`` that is not a ``bool`` (``True`` is not a chunk size or offset)."""
    return isinstance(value, int) and not isinstance(value, bool)
