"""Every coordinator reply built from the service's typed values: ``*_to_wire`` maps a value
to its wire type in :mod:`kvatlas.api` (the types clients decode with: the contract is written
once) or, for the statistics, to their JSON object.

Field names and their order are the wire contract (LMCache-compatible where it defines them;
docs/coordinator.md "API", docs/directory.md); the golden-reply tests pin every byte, the
LMCache conformance test every field LMCache's coordinator answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from msgspec import UNSET

from kvatlas import api
from kvatlas.coordinator.views import HealthView, InstanceView, Readiness, StatsView
from kvatlas.directory import (
    DirectoryStats,
    IngestCounts,
    KeyPage,
    KeyPlacements,
    Placement,
    PrefixHolder,
    TokenLookup,
)
from kvatlas.keys import BlendMatch, ObjectKey

if TYPE_CHECKING:
    from kvatlas.coordinator.kv_events.stats import KvEventsStats

# ---------------------------------------------------------------------------- placements


def key_to_wire(key: ObjectKey) -> api.KeyRow:
    return api.KeyRow(
        chunk_hash_hex=key.chunk_hash.hex(),
        model_name=key.model_name,
        kv_rank=key.kv_rank,
        object_group_id=key.object_group_id,
        cache_salt=key.cache_salt,
    )


def placement_to_wire(p: Placement) -> api.PlacementRow:
    return api.PlacementRow(
        instance_id=p.instance_id,
        incarnation=p.incarnation,
        tier=p.tier,
        backend=p.backend,
        size_bytes=p.size_bytes,
        shared=p.shared,
        last_access=p.last_access,
    )


ACCESS_COUNT_UNTRACKED = 0
"""LMCache's per-key ``access_count``: kvatlas records when a copy was last accessed
(``last_access``), not how often (docs/coordinator.md, "Differences from LMCache")."""


def lookup_result_to_wire(
    kp: KeyPlacements, placements: list[api.PlacementRow] | None = None, token_ids: Any = None
) -> api.LookupResultRow:
    """One result of a lookup: the key, its placements (``placements``: already converted)
    and its chunk's content (``[]``: unknown; ``token_ids``: already encoded), as LMCache
    answers it."""
    if placements is None:
        placements = [placement_to_wire(p) for p in kp.placements]
    if token_ids is None:
        token_ids = [] if kp.content is None else kp.content.tolist()
    return api.LookupResultRow(
        key=key_to_wire(kp.key),
        placements=placements,
        token_ids=token_ids,
        access_count=ACCESS_COUNT_UNTRACKED,
    )


def key_entry_to_wire(kp: KeyPlacements) -> api.KeyEntryRow:
    """One key of a listing: the key, its placements and how many tokens its chunk binds."""
    return api.KeyEntryRow(
        key=key_to_wire(kp.key),
        placements=[placement_to_wire(p) for p in kp.placements],
        num_tokens=0 if kp.content is None else len(kp.content),
        access_count=ACCESS_COUNT_UNTRACKED,
    )


def prefix_to_wire(h: PrefixHolder) -> api.PrefixRow:
    return api.PrefixRow(
        instance_id=h.instance_id, tier=h.tier, backend=h.backend, shared=h.shared, chunks=h.chunks
    )


def lookup_to_wire(found: TokenLookup, token_ids: Sequence[Any] | None = None) -> api.LookupReply:
    """``POST /directory/lookup`` (both forms): chunks asked, placements per key, prefix.
    Keys sharing one placements tuple (a lookup makes a batch's keys share it) share its
    wire rows, converted once. ``token_ids``: each result's ids already written as JSON
    (``msgspec.Raw``, :func:`~kvatlas.coordinator._lookup_reply.json_id_lists`), which the
    reply then holds instead of lists: a reply for the JSON encoder only."""
    rows: dict[int, list[api.PlacementRow]] = {}  # ``found`` keeps every tuple alive meanwhile
    results = []
    ids_of = [None] * len(found.results) if token_ids is None else token_ids
    for kp, ids in zip(found.results, ids_of, strict=True):
        placements = rows.get(id(kp.placements))
        if placements is None:
            placements = rows[id(kp.placements)] = [placement_to_wire(p) for p in kp.placements]
        results.append(lookup_result_to_wire(kp, placements, ids))  # (an encoder writes a Raw)
    return api.LookupReply(
        chunks=found.chunks, results=results, prefix=[prefix_to_wire(h) for h in found.prefix]
    )


def key_page_to_wire(page: KeyPage) -> api.KeyPageReply:
    """``GET /directory/keys``: how many keys match, one page and how to ask for the next
    (``None`` at the end)."""
    return api.KeyPageReply(
        total=page.total,
        keys=[key_entry_to_wire(kp) for kp in page.items],
        next_cursor=page.next_cursor,
        next_offset=page.next_offset,
    )


def blend_to_wire(
    matches: Sequence[BlendMatch],
    enabled: bool,
    placements: Sequence[Sequence[tuple[int, Sequence[Placement]]]] | None = None,
) -> api.BlendReply:
    """``POST /directory/blend-lookup`` (``_blend_reply`` writes the same bytes without
    placements, compiled). With ``placements`` (``?with_placements=true``; one list per
    match) each match says who holds it."""
    if placements is None:
        rows = [
            api.BlendMatchRow(chunk_hash=m.chunk_hash.hex(), old_st=m.old_st, cur_st=m.cur_st)
            for m in matches
        ]
    else:
        rows = [
            api.BlendMatchRow(
                chunk_hash=m.chunk_hash.hex(),
                old_st=m.old_st,
                cur_st=m.cur_st,
                placements=[
                    api.BlendHolderRow(
                        instance_id=p.instance_id,
                        tier=p.tier,
                        backend=p.backend,
                        shared=p.shared,
                        kv_rank=kv_rank,
                    )
                    for kv_rank, held in holders
                    for p in held
                ],
            )
            for m, holders in zip(matches, placements, strict=True)
        ]
    return api.BlendReply(matches=rows, enable_blend_lookup=enabled)


# ---------------------------------------------------------------------------- statistics


def directory_stats_to_wire(stats: DirectoryStats) -> dict[str, Any]:
    """The directory's statistics as ``/directory/stats`` (and the metrics gauges) show them:
    the one place they become JSON. ``blend`` is ``{"enabled": false}`` while blend lookup is
    off, else ``{"enabled": true}`` followed by the index's statistics."""
    out = dataclasses.asdict(stats)
    blend = out["blend"]
    out["blend"] = {"enabled": False} if blend is None else {"enabled": True, **blend}
    return out


def _lmcache_stats(stats: DirectoryStats) -> dict[str, Any]:
    """The statistics under LMCache's names (its coordinator's ``/directory/stats``)."""
    return {
        "num_keys": stats.keys,
        "num_placements": stats.placements,
        "l1_keys_by_instance": stats.l1_placements_by_instance,
        "l1_count": stats.placements_by_tier.get("l1", 0),
        "l1_size_bytes": stats.bytes_by_tier.get("l1", 0),
        "l2_count": stats.placements_by_tier.get("l2", 0),
        "l2_size_bytes": stats.bytes_by_tier.get("l2", 0),
    }


def stats_to_wire(view: StatsView) -> dict[str, Any]:
    """``GET /directory/stats``: LMCache's fields, the directory's statistics, then the
    service's own. ``blend`` carries LMCache's ``num_*`` and ``table_size`` too."""
    out = {
        **_lmcache_stats(view.directory),
        **directory_stats_to_wire(view.directory),
        "hash_scheme": view.hash_scheme,
        "instances_alive": view.instances_alive,
    }
    blend = view.directory.blend
    if blend is not None:
        out["blend"] = {
            "enabled": True,
            "num_contents": blend.contents,
            "num_chunks": blend.occupants,
            "num_claims": blend.claims,
            "num_namespaces": blend.namespaces,
            "table_size": blend.table_slots,
            **out["blend"],
        }
    return out


# ---------------------------------------------------------------------------- instances


def instance_to_wire(view: InstanceView) -> api.InstanceRow:
    """One ``GET /instances`` row: registration fields, liveness, cursor (the emitter's
    fields). An absent peer URL or message-queue port is ``""`` / ``0``, as LMCache answers
    them; an emitter that never registered carries every registration field LMCache's rows
    carry, as LMCache's "absent" values (LMCache's CLI reads ``ip`` and ``http_port`` of every
    row), and ``registration_time`` ``null``."""
    reg = view.registration
    if reg is None:
        return api.from_attributes(
            api.InstanceRow,
            view.emitter,
            instance_id=view.instance_id,
            ip="",
            http_port=0,
            metadata={},
            p2p_advertised_url="",
            mq_port=0,
            registration_time=None,
            alive=False,
            registered=False,
        )
    return api.from_attributes(
        api.InstanceRow,
        view.emitter,
        instance_id=view.instance_id,
        ip=reg.ip,
        http_port=reg.http_port,
        metadata=reg.metadata,
        p2p_advertised_url=reg.p2p_advertised_url or "",
        mq_port=reg.mq_port or 0,
        registration_time=view.registration_time,
        last_heartbeat_age_s=view.last_heartbeat_age_s,
        alive=True,
        registered=True,
        # kvatlas nodes only: LMCache's rows stay as they are
        p2p_url_signature=reg.p2p_url_signature or UNSET,
        engine_id=reg.engine_id or UNSET,  # kvatlas nodes serving an engine only, likewise
    )


def instances_to_wire(views: Sequence[InstanceView]) -> api.InstancesReply:
    return api.InstancesReply(instances=[instance_to_wire(v) for v in views])


def registered_to_wire(instance_id: str, re_registered: bool) -> api.RegisteredReply:
    return api.RegisteredReply(instance_id=instance_id, re_registered=re_registered)


def heartbeat_to_wire(
    instance_id: str, *, resync: bool = False, list_all: bool = False
) -> api.HeartbeatReply:
    """``resync: true`` (only when set) asks the instance for a digest exchange; ``list_all``
    for a listing of everything it holds (with ``resync: true``: an older node exchanges)."""
    return api.HeartbeatReply(
        instance_id=instance_id,
        ok=True,
        resync=True if resync or list_all else UNSET,
        list_all=True if list_all else UNSET,
    )


def ingest_counts_to_wire(counts: IngestCounts) -> api.IngestCountsReply:
    """``POST /events``: batches applied, dropped as duplicates, refused as stale."""
    return api.IngestCountsReply(
        applied=counts.applied, duplicates=counts.duplicates, stale=counts.stale
    )


def health_to_wire(h: HealthView) -> api.HealthReply:
    return api.from_attributes(
        api.HealthReply,
        h,
        state=h.state.value,
        hash_scheme=h.scheme.name,
        chunk_size=h.scheme.chunk_size,
        kv_events=UNSET if h.kv_events is None else kv_events_to_wire(h.kv_events),
    )


def kv_events_to_wire(stats: KvEventsStats) -> dict[str, dict[str, int]]:
    """``{"subscriber": {...}, "publisher": {...}}``, each side only when it runs."""
    sides = {"subscriber": stats.subscriber, "publisher": stats.publisher}
    return {name: dataclasses.asdict(side) for name, side in sides.items() if side is not None}


def readiness_to_wire(state: Readiness) -> api.ReadinessReply:
    return api.ReadinessReply(ready=state is Readiness.SERVING, state=state.value)
