"""The writes of a blend index, as typed values: what :meth:`BlendIndex.apply` takes.

Each op has exactly the effect of the method of the same name; a batch of them is applied in
order and atomically (see ``index.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from kvatlas.keys import BlendNamespace


class AddOp(NamedTuple):
    """Index ``chunk_hash`` (stored at ``token_offset``) as matchable for ``namespace``."""

    tokens: Any
    chunk_hash: bytes
    token_offset: int
    namespace: BlendNamespace


class RemoveClaimOp(NamedTuple):
    """Drop ``namespace``'s claim on the chunk; the occupant goes with its last claim."""

    tokens: Any
    chunk_hash: bytes
    namespace: BlendNamespace


class RemoveChunkOp(NamedTuple):
    """Drop the chunk's occupant and all its claims (re-stored with new content)."""

    tokens: Any
    chunk_hash: bytes


BlendOp = AddOp | RemoveClaimOp | RemoveChunkOp
"""One write of :meth:`BlendIndex.apply`: the arguments of the method of the same name."""

new_add_op: Callable[[tuple[Any, bytes, int, BlendNamespace]], AddOp] = functools.partial(
    tuple.__new__, AddOp
)
"""``new_add_op((tokens, chunk_hash, token_offset, namespace))`` is the same value as
``AddOp(tokens, chunk_hash, token_offset, namespace)``, built by a C-level call instead of
the Python-level ``AddOp.__new__``: for loops that queue an add per entry."""
