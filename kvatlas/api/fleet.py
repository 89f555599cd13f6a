"""Replies of the instance and operations routes: registration, heartbeat, ``GET /instances``,
``POST /events``, ``/healthz`` and ``/readyz``.

LMCache's coordinator answers a subset (its ``/healthz`` is ``{"status": "healthy"}``, its
instance rows list registered instances without liveness or cursors): what only kvatlas sends
has a default, so a client reads either coordinator with the same type."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

PEER_METADATA = ("kv_shape", "kv_dtype")
"""Registration ``metadata`` fields a kvatlas node sends that a peer needs (the layout of its
KV: a peer of another layout is never asked, docs/node.md): shown to a salt-bound token's view
of another instance, whose other metadata it never sees (docs/security.md)."""


class RegisteredReply(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /instances``: the instance's id (assigned when none was asked for)."""

    instance_id: str
    re_registered: bool = False


class HeartbeatReply(msgspec.Struct, kw_only=True, frozen=True):
    """``PUT /instances/{id}/heartbeat``. ``resync: true`` (sent only when set) asks the
    instance for a digest exchange; ``list_all: true`` (only when set, with ``resync``) for a
    listing of everything it holds instead (another replica lost events); LMCache answers
    ``{"instance_id"}`` only."""

    instance_id: str
    ok: bool = True
    resync: bool | UnsetType = UNSET
    list_all: bool | UnsetType = UNSET


class InstanceRow(msgspec.Struct, kw_only=True, frozen=True):
    """One ``GET /instances`` row. A registered instance (``alive``) carries its registration
    fields, LMCache's "absent" values as LMCache writes them (``""``, ``0``); an instance that
    emits without having registered carries them as those absent values (LMCache's CLI reads
    ``ip`` and ``http_port`` of every row), ``registration_time`` ``None``; ``registered`` says
    which. (A row from an older coordinator may lack them: each defaults to unset.) Then the
    emitter's cursor (``None``: it never emitted). ``p2p_url_signature`` only for a kvatlas
    node that signed its URL (docs/security.md); ``engine_id`` only for a kvatlas node that
    serves an engine (docs/route-scoring.md)."""

    instance_id: str
    ip: str | UnsetType = UNSET
    http_port: int | UnsetType | None = UNSET
    metadata: dict[str, Any] | UnsetType = UNSET
    p2p_advertised_url: str | UnsetType = UNSET
    mq_port: int | UnsetType = UNSET
    registration_time: float | UnsetType | None = UNSET
    last_heartbeat_age_s: float | UnsetType | None = UNSET
    alive: bool = True
    registered: bool | UnsetType = UNSET
    p2p_url_signature: str | UnsetType = UNSET
    engine_id: str | UnsetType = UNSET
    incarnation: int | None = None
    last_seq: int | None = None
    gaps: int = 0
    missing_batches: int = 0
    events_dropped: int = 0
    seconds_since_last_event: float | None = None
    event_delivery_delay_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.alive and self.metadata is UNSET:
            raise ValueError(f"instance {self.instance_id!r} is alive without metadata")

    @property
    def peer_url(self) -> str | None:
        """Where peers fetch its L1 (``None``: not registered, or no URL advertised)."""
        url = self.p2p_advertised_url
        return url.rstrip("/") if self.alive and isinstance(url, str) and url else None

    @property
    def signature(self) -> str | None:
        sig = self.p2p_url_signature
        return sig if isinstance(sig, str) and sig else None

    @property
    def meta(self) -> dict[str, Any]:
        """Its registration metadata (``{}`` when not registered)."""
        return self.metadata if isinstance(self.metadata, dict) else {}


class InstancesReply(msgspec.Struct, kw_only=True, frozen=True):
    instances: list[InstanceRow]


class IngestCountsReply(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /events``: batches applied, dropped as duplicates, refused as stale."""

    applied: int
    duplicates: int
    stale: int


class HealthReply(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /healthz``: liveness, the key scheme a peer must share, how events arrive.
    Every field but ``status`` is kvatlas's (``None`` from LMCache's coordinator), each named
    as the flag it reports (``--hash-scheme``, ``--chunk-size``, ``--enable-blend-lookup``);
    ``kv_events`` (counters by side, ``subscriber``/``publisher``) only when a vLLM KV-event
    link is configured."""

    status: str = "healthy"
    state: str | None = None
    hash_scheme: str | None = None
    chunk_size: int | None = None
    enable_blend_lookup: bool | None = None
    event_transport: str | None = None
    stream_position: str | None = None
    event_stream: str | None = None
    replica_id: str | None = None
    consumer_group: str | None = None
    kv_events: dict[str, dict[str, int]] | UnsetType = UNSET

    @property
    def states_hash_scheme(self) -> bool:
        """Whether the coordinator states its hash scheme (LMCache's does not)."""
        return self.hash_scheme is not None


class HealthReplyAnyRelease(HealthReply, kw_only=True, frozen=True):
    """A ``/healthz`` as a client reads it: also from a coordinator of the release before
    the names followed the flags, whose ``key_scheme`` and ``blend_lookup`` fill
    ``hash_scheme`` and ``enable_blend_lookup`` (read for one release, never sent)."""

    key_scheme: str | UnsetType = UNSET
    blend_lookup: bool | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.hash_scheme is None and isinstance(self.key_scheme, str):
            msgspec.structs.force_setattr(self, "hash_scheme", self.key_scheme)
        if self.enable_blend_lookup is None and isinstance(self.blend_lookup, bool):
            msgspec.structs.force_setattr(self, "enable_blend_lookup", self.blend_lookup)


class ReadinessReply(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /readyz`` (503 until ``ready``)."""

    ready: bool
    state: str


class DigestBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``POST /instances/{id}/digest``: per tier, inventory digests (hex) by prefix hex (``""``
    the root, one-byte prefixes below it). The coordinator checks tiers, prefixes and digests
    (``routes/resync.py``: the limits are the directory's)."""

    tiers: dict[str, dict[str, str]]


class DigestReply(msgspec.Struct, kw_only=True, frozen=True):
    """The child prefixes (hex) whose buckets differ, per tier sent."""

    instance_id: str
    tiers: dict[str, list[str]]


class ChunkSizeReply(msgspec.Struct, kw_only=True, frozen=True):
    """``PUT /config/chunk-size``: the fleet's chunk size (the coordinator's)."""

    chunk_size: int


class ReportReply(msgspec.Struct, kw_only=True, frozen=True):
    """``PUT /instances/{id}/report``: the report was accepted."""

    instance_id: str
    ok: bool = True


class ModuleUsageRow(msgspec.Struct, kw_only=True, frozen=True):
    """One (tier, backend) module of an instance, or a shared pool: the capacity its config
    batches declared beside the bytes its placements hold (``usage_ratio`` ``None`` without a
    capacity)."""

    tier: str
    backend: str
    shared: bool
    used_bytes: int
    capacity_bytes: int
    usage_ratio: float | None


class InstanceUsageReply(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /instances/{id}/usage`` (and one row of ``GET /instances/usage``)."""

    instance_id: str
    registered: bool
    declared_capacity: bool
    modules: list[ModuleUsageRow]


class FleetUsageReply(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /instances/usage``: every instance's modules, then the shared pools."""

    instances: list[InstanceUsageReply]
    shared_modules: list[ModuleUsageRow]
