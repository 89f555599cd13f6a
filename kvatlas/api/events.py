"""The event batch on the wire (``POST /events``, Redis stream entries), written once: a header
every form shares, and its two bodies — JSON (LMCache's field names; entries with a key object
and a token list) and compact msgpack (token ids as little-endian uint32 bytes, once per
distinct content; entries as positional arrays naming a content by index).

These types are the shape only: the codecs (:mod:`kvatlas.events`) decode with them and
encode from them, and every rule a batch must follow (bounds, tiers, what a config or resync
batch carries) is checked by the batch the codec builds (``kvatlas.events.EventBatch``), whose
errors name the field. A header field kvatlas writes only when it says something
(``capacity_*``, ``dropped_events``, ``prefixes``) is ``UNSET`` when absent; a key refuses
unknown fields (one may carry identity: dropping it would merge two keys — wrong KV).

The JSON entry's token list is a type parameter: the codec decodes it as ``msgspec.Raw`` (the
lists of a body are parsed in one compiled pass) and encodes it from a ``list[int]``;
:data:`EventsBody` is the contract (what ``/openapi.json`` shows).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from kvatlas.api.directory import KeyRow

UNKNOWN_OFFSET: Final = -1
"""An entry's ``token_offset`` when unknown (its tokens are never indexed)."""
PACKED_FORMAT_VERSION: Final = 1
"""The compact body's ``v``."""
NO_TOKENS: Final = msgspec.Raw(b"null")
"""An absent token list, as the JSON decoder reads it (``null``: content unknown)."""

Tokens = TypeVar("Tokens")


def _no_tokens() -> Any:
    return NO_TOKENS


class EventKey(KeyRow, frozen=True, forbid_unknown_fields=True, gc=False):
    """An entry's key (:class:`KeyRow`'s fields); unknown fields are refused."""


# Per-entry structs are not tracked by the cycle collector (``gc=False``: they hold only
# strings, ints, bytes, ``Raw`` and each other, never a cycle): a body's thousands of them
# would otherwise trigger young collections of their own.
class EventEntry(msgspec.Struct, Generic[Tokens], gc=False):
    """One key of a JSON batch: its chunk's size, token ids (``null`` or ``[]``: unknown) and
    their offset in the request (``-1``: unknown)."""

    key: EventKey
    size_bytes: int = 0
    token_ids: Tokens = msgspec.field(default_factory=_no_tokens)
    token_offset: int = UNKNOWN_OFFSET


class BatchHeader(msgspec.Struct):
    """What every form of a batch carries besides its entries: one event type on one
    (instance, tier, backend), ordered by ``(incarnation, seq)``. ``backend`` ``null`` reads
    as ``""`` (as LMCache's pydantic models may send it)."""

    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str | None = ""
    shared: bool = False
    ts: float = 0.0
    capacity_bytes: int | UnsetType | None = UNSET
    capacity_revision: int | UnsetType | None = UNSET
    dropped_events: int | UnsetType = UNSET
    prefixes: list[str] | UnsetType | None = UNSET


class EventBatchRow(BatchHeader, Generic[Tokens]):
    """A JSON batch: the header, then its entries."""

    entries: list[EventEntry[Tokens]] = []


class EventsBodyOf(msgspec.Struct, Generic[Tokens]):
    """A JSON ``POST /events`` body (``Content-Type: application/json``)."""

    batches: list[EventBatchRow[Tokens]]


TokenList = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]] | None,
    msgspec.Meta(description="the chunk's token ids (null or []: unknown)"),
]
EventsBody = EventsBodyOf[TokenList]
"""The JSON body as the contract states it: token lists as lists of uint32."""


class PackedEntry(msgspec.Struct, array_like=True, gc=False):
    """One key of a compact batch, as an array: the key's fields (the chunk hash as its 32
    bytes), size, token offset, and the index of its content in the batch's ``contents``
    (``-1``: no tokens)."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""
    size_bytes: int = 0
    token_offset: int = UNKNOWN_OFFSET
    content: int = -1


class PackedBatch(BatchHeader):
    """A compact batch: the header, each distinct token content once (little-endian uint32
    bytes), then its entries."""

    contents: list[bytes] = []
    entries: list[PackedEntry] = []


class PackedEventsBody(msgspec.Struct, kw_only=True):
    """A compact ``POST /events`` body (``Content-Type: application/msgpack``)."""

    v: int = PACKED_FORMAT_VERSION
    batches: list[PackedBatch]
