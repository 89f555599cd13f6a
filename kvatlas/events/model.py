"""Cache-event model: one batch = one emitter step (type, tier, backend) with its entries.

Everything is validated on construction, so code behind the ingest gate can trust a batch and
apply it atomically: a batch that exists is a batch that can be applied.
Token ids are held as read-only ``uint32`` arrays (1 KiB per 256-token chunk, shared, never
tuples of Python ints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np
from msgspec import UNSET

from kvatlas.api.events import UNKNOWN_OFFSET, BatchHeader
from kvatlas.checks import is_plain_int
from kvatlas.events.errors import EventValidationError
from kvatlas.events.inventory import BUCKETS, check_prefix
from kvatlas.keys import ObjectKey, TokenArray, as_token_array

STORE: Final = "store"
DELETE: Final = "delete"
ACCESS: Final = "access"
CONFIG: Final = "config"
RESYNC: Final = "resync"
EVENT_TYPES: Final = frozenset({STORE, DELETE, ACCESS, CONFIG, RESYNC})
TIERS: Final = frozenset({"l1", "l2", "gpu", "engine-cpu"})
"""Where a copy sits: a node's DRAM (l1) or storage (l2), or an engine's own memory (gpu, and
engine-cpu for its CPU offload; learned from its vLLM KV events, docs/kv-events.md)."""
ENGINE_TIERS: Final = frozenset({"gpu", "engine-cpu"})
"""Engine memory: seen by lookups and routers, never fetchable by a node."""
VOLATILE_TIERS: Final = frozenset({"l1", "gpu", "engine-cpu"})
"""Process memory: an instance's own copies there are dropped when it is fenced."""
EVENT_TRANSPORTS: Final = ("http", "redis")
"""How batches travel from nodes to the coordinator (``--event-transport`` of both)."""

U64_MAX: Final = (1 << 64) - 1
I64_MAX: Final = (1 << 63) - 1
MAX_ID_CHARS: Final = 256
MAX_PREFIXES: Final = BUCKETS * BUCKETS

INT_BOUNDS: Final[dict[str, tuple[int, int]]] = {
    "incarnation": (0, U64_MAX),
    "seq": (1, U64_MAX),
    "capacity_bytes": (0, I64_MAX),
    "capacity_revision": (0, I64_MAX),
    "size_bytes": (0, I64_MAX),
    "token_offset": (UNKNOWN_OFFSET, I64_MAX),
    "dropped_events": (0, I64_MAX),
}
"""The inclusive range of every integer field the model checks (the events schema shows them)."""


def _int_in(name: str, value: Any) -> int:
    lo, hi = INT_BOUNDS[name]
    if not is_plain_int(value) or not lo <= value <= hi:
        raise EventValidationError(name, f"must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def _name(name: str, value: Any, *, required: bool) -> str:
    if not isinstance(value, str):
        raise EventValidationError(name, f"must be a string, got {type(value).__name__}")
    if required and not value:
        raise EventValidationError(name, "must be a non-empty string")
    if len(value) > MAX_ID_CHARS or "\x00" in value:
        raise EventValidationError(name, f"must be at most {MAX_ID_CHARS} characters, no NUL")
    return value


def readonly_tokens(token_ids: Any) -> TokenArray:
    """``token_ids`` as a read-only 1-D uint32 array; a writable input is copied, never aliased."""
    arr = as_token_array(token_ids)
    if arr.flags.writeable:
        arr = arr.copy() if arr.base is not None or arr is token_ids else arr
        arr.flags.writeable = False
    return arr


def tokens_equal(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Whether two token arrays hold the same ids, whatever their widths (the directory
    stores contents as ``uint16`` or ``uint32``: ``directory/token_store.py``)."""
    return a is b or (a.shape == b.shape and bool(np.array_equal(a, b)))


@dataclass(frozen=True, slots=True, eq=False)
class CacheEntry:
    """One key of a batch. ``token_offset == -1`` means unknown (never indexed, see directory)."""

    key: ObjectKey
    size_bytes: int = 0
    token_ids: TokenArray | None = None
    token_offset: int = UNKNOWN_OFFSET

    def __post_init__(self) -> None:
        if not isinstance(self.key, ObjectKey):
            raise EventValidationError("key", "must be an ObjectKey")
        if self.key.object_group_id > U64_MAX:
            raise EventValidationError("key.object_group_id", "must fit in 64 bits")
        _int_in("size_bytes", self.size_bytes)
        _int_in("token_offset", self.token_offset)
        tokens = self.token_ids
        if tokens is not None:
            try:
                arr = readonly_tokens(tokens)
            except ValueError as exc:
                raise EventValidationError("token_ids", str(exc)) from None
            # No tokens and an empty list say the same thing: content unknown.
            object.__setattr__(self, "token_ids", arr if len(arr) else None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheEntry):
            return NotImplemented
        a, b = self.token_ids, other.token_ids
        same_tokens = (a is None and b is None) or (
            a is not None and b is not None and tokens_equal(a, b)
        )
        return (
            self.key == other.key
            and self.size_bytes == other.size_bytes
            and self.token_offset == other.token_offset
            and same_tokens
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """A batch of one event type on one (instance, tier, backend), ordered by ``seq``.

    ``incarnation`` must grow on every emitter restart; ``seq`` starts at 1 and grows by one per
    batch within an incarnation. ``config`` batches carry no entries, only a capacity
    declaration (LMCache MP servers send them; they are accepted, never rejected).
    ``dropped_events``: events the emitter dropped (e.g. a full queue) since its previous batch;
    the coordinator counts them and shows a gap for the emitter (LMCache 0.5.7).

    LMCache's pydantic models send every default: ``capacity_bytes: 0`` and
    ``capacity_revision: 0`` on a batch that is not a config batch mean "absent" (stored as
    ``None``); any other value there is still refused.

    ``resync`` batches list every placement the emitter holds on its own (not shared) ``tier``
    whose chunk hash starts with one of ``prefixes`` (hex of 1 or 2 bytes, see
    :mod:`kvatlas.events.inventory`); the directory replaces its view of exactly those.
    """

    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str = ""
    shared: bool = False
    ts: float = 0.0
    entries: tuple[CacheEntry, ...] = field(default=())
    capacity_bytes: int | None = None
    capacity_revision: int | None = None
    dropped_events: int = 0
    prefixes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _name("instance_id", self.instance_id, required=True)
        _int_in("incarnation", self.incarnation)
        _int_in("seq", self.seq)
        if self.event_type not in EVENT_TYPES:
            raise EventValidationError(
                "event_type", f"must be one of {sorted(EVENT_TYPES)}, got {self.event_type!r:.40}"
            )
        if self.tier not in TIERS:
            raise EventValidationError(
                "tier", f"must be one of {sorted(TIERS)}, got {self.tier!r:.40}"
            )
        _name("backend", self.backend, required=self.event_type in (STORE, DELETE, RESYNC))
        if not isinstance(self.shared, bool):
            raise EventValidationError("shared", "must be a boolean")
        ts = self.ts
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise EventValidationError("ts", f"must be a finite number, got {ts!r:.40}")
        object.__setattr__(self, "ts", float(ts))
        entries = self.entries
        if not isinstance(entries, tuple):
            entries = tuple(entries)
            object.__setattr__(self, "entries", entries)
        for i, entry in enumerate(entries):
            if not isinstance(entry, CacheEntry):
                raise EventValidationError(f"entries[{i}]", "must be a CacheEntry")
        _int_in("dropped_events", self.dropped_events)
        self._check_config()
        self._check_resync()

    def _check_config(self) -> None:
        if self.event_type == CONFIG:
            if self.entries:
                raise EventValidationError("entries", "a config batch carries no entries")
            for name in ("capacity_bytes", "capacity_revision"):
                value = getattr(self, name)
                if value is None:
                    raise EventValidationError(name, "is required for a config batch")
                _int_in(name, value)
        else:
            for name in ("capacity_bytes", "capacity_revision"):
                value = getattr(self, name)
                if is_plain_int(value) and value == 0:  # LMCache's default: absent
                    object.__setattr__(self, name, None)
                elif value is not None:
                    raise EventValidationError(name, "is only allowed on a config batch")

    def _check_resync(self) -> None:
        prefixes = self.prefixes
        if self.event_type != RESYNC:
            if prefixes is not None:
                raise EventValidationError("prefixes", "is only allowed on a resync batch")
            return
        if self.shared:
            raise EventValidationError("shared", "a resync batch lists the emitter's own copies")
        if prefixes is None or not prefixes:
            raise EventValidationError("prefixes", "a resync batch names at least one prefix")
        if not isinstance(prefixes, tuple):
            prefixes = tuple(prefixes)
            object.__setattr__(self, "prefixes", prefixes)
        if len(prefixes) > MAX_PREFIXES:
            raise EventValidationError("prefixes", f"at most {MAX_PREFIXES} prefixes")
        try:
            raw = self.prefix_bytes
        except ValueError as exc:
            raise EventValidationError("prefixes", str(exc)) from None
        for i, entry in enumerate(self.entries):
            h = entry.key.chunk_hash
            if h[:1] not in raw and h[:2] not in raw:
                raise EventValidationError(
                    f"entries[{i}].key", "chunk hash outside the batch's prefixes"
                )

    @property
    def prefix_bytes(self) -> frozenset[bytes]:
        """A resync batch's prefixes as bytes (empty for other types)."""
        return frozenset(check_prefix(p) for p in self.prefixes or ())

    @property
    def emitter(self) -> tuple[str, int, int]:
        return (self.instance_id, self.incarnation, self.seq)


H = TypeVar("H", bound=BatchHeader)


def header_to_wire(batch: EventBatch, row: type[H], **rest: Any) -> H:
    """``batch``'s header as the wire form ``row`` (a :class:`~kvatlas.api.events.BatchHeader`
    of a codec), with ``rest`` (its entries); what says nothing is left ``UNSET`` (unsent)."""
    cap, prefixes = batch.capacity_bytes, batch.prefixes
    return row(
        batch.instance_id, batch.incarnation, batch.seq, batch.event_type, batch.tier,
        batch.backend, batch.shared, batch.ts,
        UNSET if cap is None else cap,
        UNSET if cap is None else batch.capacity_revision,
        batch.dropped_events or UNSET,
        UNSET if prefixes is None else list(prefixes),
        **rest,
    )  # fmt: skip


def batch_from_wire(
    wb: BatchHeader, entries: tuple[CacheEntry, ...], instance_id: str, backend: str
) -> EventBatch:
    """The batch of a decoded wire header (the inverse of :func:`header_to_wire`) with
    ``entries``; ``instance_id`` and ``backend`` as the codec read them (interned, defaulted).
    Raises :class:`EventValidationError` like any :class:`EventBatch`."""
    cap, rev, dropped, prefixes = (
        wb.capacity_bytes, wb.capacity_revision, wb.dropped_events, wb.prefixes
    )  # fmt: skip
    return EventBatch(
        instance_id=instance_id,
        incarnation=wb.incarnation,
        seq=wb.seq,
        event_type=wb.event_type,
        tier=wb.tier,
        backend=backend,
        shared=wb.shared,
        ts=wb.ts,
        entries=entries,
        capacity_bytes=None if cap is UNSET else cap,
        capacity_revision=None if rev is UNSET else rev,
        dropped_events=0 if dropped is UNSET else dropped,
        prefixes=None if prefixes is UNSET or prefixes is None else tuple(prefixes),
    )
