"""Cache control on the wire: the bodies and replies of the MP-server routes a cache node answers
(``DELETE /cache/objects``, ``POST /cache/prefetches``, ``GET /cache/prefetches/{request_id}``,
``GET /cache/objects``, ``POST /cache/clear``), shaped as LMCache 0.5.6's ``lmcache server``
answers them, so LMCache's coordinator can drive a kvatlas node and kvatlas's coordinator an
LMCache server (``docs/cache-control.md`` records both).

A body field LMCache's server accepts is accepted here with the same default (``tier`` of a
delete defaults to ``l2``, as LMCache's eviction loop expects); a body field it does not know is
refused (422), where LMCache ignores it: a misspelt ``tier`` or ``force`` must not turn into a
different delete than the operator asked for. Key invariants (hash length, model name, salt,
``kv_rank``) are checked where a key is built (:class:`~kvatlas.keys.ObjectKey`: 400).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Annotated, Final, Literal

import msgspec

from kvatlas.errors import InvalidInput

TierName = Literal["l1", "l2", "all"]
"""A tier selector on the wire (LMCache's ``Tier``); which a route accepts is the route's rule."""

DEFAULT_SALT_NAME: Final = "_default"
"""How a path or query names the empty salt (``PUT /quota/_default``, ``GET /cache/pins?
cache_salt=_default``), on both sides."""
MAX_DELETE_KEYS: Final = 10_000
"""Keys one ``DELETE /cache/objects`` may name (LMCache's ``MAX_DELETE_BATCH``): 400 beyond."""
MAX_TOKEN_IDS: Final = 1_000_000
"""Token ids one token-addressed request may carry (LMCache's ``MAX_TOKEN_IDS``): 400 beyond."""


def check_token_count(token_ids: Sized) -> None:
    """400 (:class:`~kvatlas.errors.InvalidInput`, LMCache's words) beyond
    :data:`MAX_TOKEN_IDS`."""
    if len(token_ids) > MAX_TOKEN_IDS:
        raise InvalidInput(
            f"too many token_ids in a single request (limit={MAX_TOKEN_IDS}, got={len(token_ids)})"
        )


MAX_PAGE_SIZE: Final = 5000
DEFAULT_PAGE_SIZE: Final = 500


class EncodedKey(msgspec.Struct, forbid_unknown_fields=True):
    """An ObjectKey on the wire (LMCache's ``EncodedObjectKey``; :meth:`ObjectKey.to_wire`)."""

    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class DeleteObjectsBody(msgspec.Struct, forbid_unknown_fields=True):
    """``DELETE /cache/objects``: remove ``keys`` from ``tier``; without ``force`` an L1 key
    held for a transfer is skipped. ``adapter`` names the L2 backend (``None``: the node's)."""

    keys: list[EncodedKey]
    tier: TierName = "l2"
    force: bool = False
    adapter: str | None = None


class DeleteObjectsReply(msgspec.Struct):
    """``deleted``: copies removed, L1 and L2 summed; ``skipped``: L1 keys held (not
    ``force``); ``ok`` false with ``error`` when the L2 backend failed (a result, not a 5xx)."""

    deleted: int
    skipped: int
    ok: bool
    error: str | msgspec.UnsetType = msgspec.UNSET  # UNSET: not encoded


class PrefetchBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /cache/prefetches``: load the complete chunks of ``token_ids`` from L2 into L1."""

    model_name: str
    world_size: int
    token_ids: list[int]
    cache_salt: str = ""
    source_tier: TierName = "l2"
    target_tier: TierName = "l1"


class PrefetchSubmitted(msgspec.Struct):
    """202: ``{request_id, chunks, status: "submitted"}``, or ``{chunks: 0, status: "noop"}``
    for fewer tokens than one chunk (no job, no id)."""

    chunks: int
    status: Literal["submitted", "noop"]
    request_id: str | msgspec.UnsetType = msgspec.UNSET


class PrefetchStatusReply(msgspec.Struct):
    """``{request_id, status: "pending"}`` or ``{request_id, status: "completed", found_keys,
    total_keys}``: ``found_keys`` of the request's ``total_keys`` are in L1 now."""

    request_id: str
    status: Literal["pending", "completed"]
    found_keys: int | msgspec.UnsetType = msgspec.UNSET
    total_keys: int | msgspec.UnsetType = msgspec.UNSET


MAX_HOLD_S: Final = 3600.0
"""The longest a move's hold may last without being set again (``PUT /cache/holds``)."""


class HoldBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /cache/holds/{hold_id}`` (kvatlas nodes only; a move's target): bring the complete
    chunks of ``token_ids`` into L1 -- from this node's own L2, else from
    ``source_instance_id``'s L1, else its private L2 -- and hold every one L1 then has for
    ``ttl_s`` (its LRU passes them by) until the hold is released or set again."""

    model_name: str
    world_size: int
    token_ids: list[int]
    source_instance_id: str
    cache_salt: str = ""
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_HOLD_S)] = 600.0


class HoldReply(msgspec.Struct):
    """``held``: the keys L1 holds (and keeps) now; ``missing``: those no tier had (the source
    lacked them) or L1 had no room for (``no_room`` of them); ``unfinished``: how many it had
    no time left to load in this call (set the hold again: it goes on from there)."""

    hold_id: str
    held: list[EncodedKey]
    missing: list[EncodedKey]
    no_room: int
    unfinished: int = 0


class ReleaseReply(msgspec.Struct):
    """``DELETE /cache/holds/{hold_id}``: how many keys the hold kept (0: unknown, expired, or
    released already: a release is idempotent)."""

    hold_id: str
    released: int


class ObjectEntry(msgspec.Struct):
    """One listed object: its key and its stored size."""

    key: EncodedKey
    size_bytes: int


class ObjectPage(msgspec.Struct):
    """``GET /cache/objects``: one page of the L2 backend's keys; ``next_page_token`` is
    ``None`` on the last page, else the token to pass for the next one."""

    adapter: str
    shared: bool
    entries: list[ObjectEntry]
    next_page_token: str | None


class ObjectsQuery(msgspec.Struct):
    """``GET /cache/objects``'s query: the tier and backend to list (``adapter``: the node's
    own L2 when absent), the model whose keys, and the page."""

    tier: TierName = "l2"
    adapter: str | None = None
    model_name: str | None = None
    page_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE
    page_token: str | None = None


class ClearBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /cache/clear`` (body optional): empty L1; ``force`` also drops keys held for a
    transfer."""

    tier: TierName = "l1"
    force: bool = False


class ClearedTier(msgspec.Struct):
    tier: Literal["l1"]


class ClearReply(msgspec.Struct):
    status: Literal["ok"]
    cleared: ClearedTier


# ------------------------------------------------------------------------ coordinator routes
# The coordinator's cache-control bodies and replies (docs/cache-control.md; LMCache 0.5.7rc2's
# coordinator answering them: tests/coordinator/data/lmcache-0.5.7rc2-cache-control.json).

MAX_PIN_PAGE: Final = 10_000


class TokenFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a coordinator request resolves to keys with its own hashing: complete chunks only,
    one key per rank (``world_size`` >= 1, 422 below)."""

    model_name: str
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    token_ids: list[int]
    cache_salt: str = ""


class PinReply(msgspec.Struct):
    """``POST``/``DELETE /cache/pins``: ``requested`` chunks, ``affected`` keys."""

    requested: int
    affected: int
    status: Literal["pinned", "unpinned"]


class PinRow(msgspec.Struct):
    key: EncodedKey
    pin_count: int


class PinsReply(msgspec.Struct):
    total: int
    pins: list[PinRow]


class CoordinatorDeleteBody(TokenFields, kw_only=True, forbid_unknown_fields=True):
    """``POST /cache/delete``: the keys of ``token_ids`` on ``instance_id``'s ``tier``."""

    instance_id: str
    tier: TierName = "all"
    force: bool = False


class CoordinatorDeleteReply(msgspec.Struct):
    instance_id: str
    requested: int
    affected: int
    skipped: int
    status: Literal["deleted", "noop"]


class CoordinatorPrefetchBody(TokenFields, kw_only=True, forbid_unknown_fields=True):
    """``POST /cache/prefetches`` on the coordinator: L2 -> L1 on ``instance_id``."""

    instance_id: str


class CoordinatorPrefetchReply(msgspec.Struct):
    instance_id: str
    request_id: str
    chunks: int
    status: Literal["submitted", "noop"]


MAX_QUOTA_GB: Final = float(1 << 33)
"""The largest quota: 2^33 GB is 2^63 bytes, the most a byte count (``int64``) holds; an
infinite limit or one beyond it cannot be counted against (the status page's bar was a 500)."""
QuotaGB = Annotated[float, msgspec.Meta(ge=0, le=MAX_QUOTA_GB)]
"""A quota in GB: a finite number in [0, 2^33] (a string, ``"NaN"`` included, is refused: the
bodies are decoded strictly); ``-0.0`` is taken as ``0.0``."""


class QuotaConfig(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT``/``GET /quota/config``: ``None`` = salts without a quota of their own are exempt;
    ``0`` = they may hold nothing (evicted)."""

    default_limit_gb: QuotaGB | None = None
    tier: Literal["l2"] | msgspec.UnsetType = msgspec.UNSET  # LMCache's clients send it

    def __post_init__(self) -> None:
        if self.default_limit_gb is not None:
            self.default_limit_gb = _no_minus_zero(self.default_limit_gb)


class QuotaSetBody(msgspec.Struct, forbid_unknown_fields=True):
    limit_gb: QuotaGB
    tier: Literal["l2"] = "l2"

    def __post_init__(self) -> None:
        self.limit_gb = _no_minus_zero(self.limit_gb)


def _no_minus_zero(limit_gb: float) -> float:
    """``-0.0`` (which is ``>= 0``) is the quota ``0.0``: kept, listed and answered as ``0.0``."""
    return limit_gb + 0.0


class QuotaSetReply(msgspec.Struct):
    """``PUT``/``DELETE /quota/{cache_salt}``: ``status`` ``ok``, or ``removed`` / ``not_found``
    (no quota to remove; LMCache's answer) with ``limit_gb`` 0.0."""

    cache_salt: str
    limit_gb: float
    status: Literal["ok", "removed", "not_found"]


class QuotaStatus(msgspec.Struct):
    """One salt: its own quota (``quota_limit_gb`` 0.0 with ``quota_exists`` false when it has
    none, as LMCache answers) and the bytes its keys hold, in GB (2^30 bytes)."""

    cache_salt: str
    quota_limit_gb: float
    quota_exists: bool
    usage_gb: float


class QuotaList(msgspec.Struct):
    total_gb: float
    by_cache_salt: list[QuotaStatus]


class CoordinatorPrefetchStatus(msgspec.Struct):
    """``GET /cache/prefetches/{instance_id}/{request_id}``: ``{status: "pending"}`` or
    ``{status: "completed", found_keys, total_keys}``."""

    status: Literal["pending", "completed"]
    found_keys: int | msgspec.UnsetType = msgspec.UNSET
    total_keys: int | msgspec.UnsetType = msgspec.UNSET


class MoveBody(TokenFields, kw_only=True, forbid_unknown_fields=True):
    """``POST /cache/moves``: the keys of ``token_ids`` from ``source_instance_id``'s L1 to
    ``target_instance_id``'s; ``keep_source`` leaves the source's copy (a copy, not a move)."""

    source_instance_id: str
    target_instance_id: str
    keep_source: bool = False


class MoveReply(msgspec.Struct):
    move_id: str
    source_instance_id: str
    target_instance_id: str
    requested: int
    status: Literal["pending", "noop"]


class PinsQuery(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /cache/pins``'s query: an empty ``cache_salt`` lists every salt (``_default``
    names the empty one), ``limit`` 1-10,000 (422 outside)."""

    cache_salt: str = ""
    model_name: str = ""
    offset: int = 0
    limit: int = 1000


class NodePinsQuery(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /instances/{instance_id}/pins``'s query: a node reading its own pins (its model's
    keys in the salts its token is bound to); ``limit`` 1-10,000 (422 outside)."""

    model_name: str = ""
    offset: int = 0
    limit: int = 1000


class MoveStatus(msgspec.Struct):
    """``GET /cache/moves/{move_id}``: where a move stands. ``phase``: ``queued`` (recorded),
    ``loading`` (the target is asked to load and hold the keys), ``holding`` (it holds them;
    waiting for the directory to show them), ``deleting`` (the source's L1 copies),
    ``done``; ``requested`` chunks, ``loaded`` keys the target holds, ``missing`` keys no
    tier had (or the target's L1 had no room for), ``deleted`` source copies removed,
    ``skipped`` pinned source copies left (a move is no forced delete)."""

    move_id: str
    source_instance_id: str
    target_instance_id: str
    status: Literal["pending", "completed", "failed"]
    phase: str
    requested: int
    loaded: int
    missing: int
    deleted: int
    skipped: int
    error: str | None
