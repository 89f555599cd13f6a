"""A cache node's peer API (``POST /peer/kv``, :mod:`kvatlas.node.peer`): the fetch body and
the reply's records, imported by the serving node and the fetching one alike.

The body's keys are a type parameter: the contract is :data:`PeerFetch` (keys as
:class:`~kvatlas.api.events.EventKey`, unknown key fields refused); the serving node reads
them as ``msgspec.Raw`` first, so that a body that is not a fetch is a 400 while a key that is
not a key is a 422 naming it (``keys[i]``).
"""

from __future__ import annotations

from typing import Final, Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from kvatlas.api.events import EventKey

PEER_TIERS: Final = ("l1", "l2")
"""The tiers a fetch may name."""
DEFAULT_TIERS: Final = ("l1",)

Key = TypeVar("Key")


class PeerFetchOf(msgspec.Struct, Generic[Key], forbid_unknown_fields=True):
    """``POST /peer/kv`` (JSON): the keys wanted and the tiers to read them from, any
    non-empty subset of :data:`PEER_TIERS` (``l1`` only when absent: the bare form every
    peer reads)."""

    keys: list[Key]
    tiers: list[str] | UnsetType = UNSET

    @property
    def tier_set(self) -> frozenset[str]:
        return frozenset(DEFAULT_TIERS if self.tiers is UNSET else self.tiers)


PeerFetch = PeerFetchOf[EventKey]


class PeerRecord(msgspec.Struct):
    """One chunk of the reply (a msgpack array of these, one per key held): the chunk
    without its token ids (``encode_chunk`` bytes; decoded as a view into the reply buffer, no
    copy) and the 32-byte digest of its token ids (``None``: it has none)."""

    chunk: memoryview
    tokens_digest: bytes | None = None
