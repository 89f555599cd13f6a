"""The JSON form of every coordinator reply, written once: ``*_to_wire`` builds a reply from
the service's typed values, ``*_from_wire`` reads one back (what a client such as
:mod:`kvatlas.node.fleet_view` uses), side by side so the two cannot drift apart.

Field names and their order are the wire contract (LMCache-compatible where it defines them;
docs/coordinator.md "API", docs/directory.md); the golden-reply tests pin every byte, the
LMCache conformance test every field LMCache's coordinator answers. A ``*_from_wire`` raises
``ValueError`` on a reply that is not of this form (missing field, wrong type), never returns
a half-read value; it also reads LMCache's replies where they overlap (fields only kvatlas
sends are optional there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvatlas.checks import is_plain_int
from kvatlas.coordinator.instances import Registration
from kvatlas.coordinator.views import EmitterView, HealthView, InstanceView, Readiness, StatsView
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

# ---------------------------------------------------------------------------- reading helpers


def _get(obj: Any, name: str) -> Any:
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected an object with {name!r}, got {type(obj).__name__}")
    if name not in obj:
        raise ValueError(f"reply has no {name!r}")
    return obj[name]


def _str(obj: Any, name: str) -> str:
    value = _get(obj, name)
    if not isinstance(value, str):
        raise ValueError(f"{name} is not a string")
    return value


def _int(obj: Any, name: str) -> int:
    value = _get(obj, name)
    if not is_plain_int(value):
        raise ValueError(f"{name} is not an integer")
    return value


def _bool(obj: Any, name: str) -> bool:
    value = _get(obj, name)
    if not isinstance(value, bool):
        raise ValueError(f"{name} is not a boolean")
    return value


def _float(obj: Any, name: str) -> float:
    value = _get(obj, name)
    if not (is_plain_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} is not a number")
    return float(value)


def _optional(read: Any, obj: Any, name: str) -> Any:
    return None if _get(obj, name) is None else read(obj, name)


def _opt_int(obj: Any, name: str) -> int | None:
    value: int | None = _optional(_int, obj, name)
    return value


def _opt_float(obj: Any, name: str) -> float | None:
    value: float | None = _optional(_float, obj, name)
    return value


def _if_sent(read: Any, obj: Any, name: str, default: Any) -> Any:
    """A field only kvatlas sends: ``default`` when an LMCache reply lacks it."""
    return read(obj, name) if isinstance(obj, Mapping) and name in obj else default


def _list(obj: Any, name: str) -> list[Any]:
    value = _get(obj, name)
    if not isinstance(value, list):
        raise ValueError(f"{name} is not a list")
    return value


# ---------------------------------------------------------------------------- placements


def placement_to_wire(p: Placement) -> dict[str, Any]:
    return {
        "instance_id": p.instance_id,
        "incarnation": p.incarnation,
        "tier": p.tier,
        "backend": p.backend,
        "size_bytes": p.size_bytes,
        "shared": p.shared,
        "last_access": p.last_access,
    }


def placement_from_wire(obj: Any) -> Placement:
    return Placement(
        _str(obj, "instance_id"),
        _int(obj, "incarnation"),
        _str(obj, "tier"),
        _str(obj, "backend"),
        _int(obj, "size_bytes"),
        _bool(obj, "shared"),
        _if_sent(_float, obj, "last_access", 0.0),
    )


ACCESS_COUNT_UNTRACKED = 0
"""LMCache's per-key ``access_count``: kvatlas records when a copy was last accessed
(``last_access``), not how often (docs/coordinator.md, "Differences from LMCache")."""


def key_placements_to_wire(kp: KeyPlacements) -> dict[str, Any]:
    return {"key": kp.key.to_wire(), "placements": [placement_to_wire(p) for p in kp.placements]}


def lookup_result_to_wire(kp: KeyPlacements) -> dict[str, Any]:
    """One result of a lookup: the key, its placements and its chunk's content (``[]``:
    unknown), as LMCache answers it."""
    return {
        **key_placements_to_wire(kp),
        "token_ids": [] if kp.content is None else kp.content.tolist(),
        "access_count": ACCESS_COUNT_UNTRACKED,
    }


def key_entry_to_wire(kp: KeyPlacements) -> dict[str, Any]:
    """One key of a listing: the key, its placements and how many tokens its chunk binds."""
    return {
        **key_placements_to_wire(kp),
        "num_tokens": 0 if kp.content is None else len(kp.content),
        "access_count": ACCESS_COUNT_UNTRACKED,
    }


def key_placements_from_wire(obj: Any) -> KeyPlacements:
    key = _get(obj, "key")
    if not isinstance(key, dict):
        raise ValueError("key is not an object")
    return KeyPlacements(ObjectKey.from_wire(key), _placements_from_wire(obj))


def _placements_from_wire(obj: Any) -> tuple[Placement, ...]:
    return tuple(placement_from_wire(p) for p in _list(obj, "placements"))


def lookup_placements_from_wire(obj: Any) -> list[tuple[Placement, ...]]:
    """Only the placements of each result of a keys-form lookup, in request order: for a
    caller that knows the keys it asked for (the keys are not parsed again)."""
    return [_placements_from_wire(r) for r in _list(obj, "results")]


def prefix_to_wire(h: PrefixHolder) -> dict[str, Any]:
    return {
        "instance_id": h.instance_id,
        "tier": h.tier,
        "backend": h.backend,
        "shared": h.shared,
        "chunks": h.chunks,
    }


def prefix_from_wire(obj: Any) -> PrefixHolder:
    return PrefixHolder(
        _optional(_str, obj, "instance_id"),
        _str(obj, "tier"),
        _str(obj, "backend"),
        _bool(obj, "shared"),
        _int(obj, "chunks"),
    )


def lookup_to_wire(found: TokenLookup) -> dict[str, Any]:
    """``POST /directory/lookup`` (both forms): chunks asked, placements per key, prefix."""
    return {
        "chunks": found.chunks,
        "results": [lookup_result_to_wire(kp) for kp in found.results],
        "prefix": [prefix_to_wire(h) for h in found.prefix],
    }


def lookup_from_wire(obj: Any) -> TokenLookup:
    return TokenLookup(
        _int(obj, "chunks"),
        [key_placements_from_wire(r) for r in _list(obj, "results")],
        [prefix_from_wire(h) for h in _list(obj, "prefix")],
    )


def key_page_to_wire(page: KeyPage) -> dict[str, Any]:
    """``GET /directory/keys``: how many keys match, one page and how to ask for the next
    (``None`` at the end)."""
    return {
        "total": page.total,
        "keys": [key_entry_to_wire(kp) for kp in page.items],
        "next_cursor": page.next_cursor,
        "next_offset": page.next_offset,
    }


def key_page_from_wire(obj: Any) -> KeyPage:
    return KeyPage(
        [key_placements_from_wire(k) for k in _list(obj, "keys")],
        _optional(_str, obj, "next_cursor"),
        _opt_int(obj, "next_offset"),
        _if_sent(_opt_int, obj, "total", None),
    )


def blend_to_wire(
    matches: Sequence[BlendMatch],
    enabled: bool,
    placements: Sequence[Sequence[tuple[int, Sequence[Placement]]]] | None = None,
) -> dict[str, Any]:
    """``POST /directory/blend-lookup``; read back by ``kvatlas.client.blend_client`` (which
    must not import the directory, so it keeps its own strict parser). With ``placements``
    (``?with_placements=true``; one list per match) each match says who holds it."""
    if placements is not None:
        return {
            "matches": [
                {
                    "chunk_hash": m.chunk_hash.hex(),
                    "old_st": m.old_st,
                    "cur_st": m.cur_st,
                    "placements": [
                        {
                            "instance_id": p.instance_id,
                            "tier": p.tier,
                            "backend": p.backend,
                            "shared": p.shared,
                            "kv_rank": kv_rank,
                        }
                        for kv_rank, held in holders
                        for p in held
                    ],
                }
                for m, holders in zip(matches, placements, strict=True)
            ],
            "blend_enabled": enabled,
        }
    return {
        "matches": [
            {"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st}
            for m in matches
        ],
        "blend_enabled": enabled,
    }


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
        "key_scheme": view.key_scheme,
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


def emitter_to_wire(e: EmitterView) -> dict[str, Any]:
    return {
        "incarnation": e.incarnation,
        "last_seq": e.last_seq,
        "gaps": e.gaps,
        "missing_batches": e.missing_batches,
        "events_dropped": e.events_dropped,
        "seconds_since_last_event": e.seconds_since_last_event,
        "event_delivery_delay_seconds": e.event_delivery_delay_seconds,
    }


def emitter_from_wire(obj: Any) -> EmitterView:
    return EmitterView(
        _if_sent(_opt_int, obj, "incarnation", None),
        _if_sent(_opt_int, obj, "last_seq", None),
        _if_sent(_int, obj, "gaps", 0),
        _if_sent(_int, obj, "missing_batches", 0),
        _if_sent(_int, obj, "events_dropped", 0),
        _if_sent(_opt_float, obj, "seconds_since_last_event", None),
        _if_sent(_opt_float, obj, "event_delivery_delay_seconds", None),
    )


def instance_to_wire(view: InstanceView) -> dict[str, Any]:
    """One ``GET /instances`` row: registration fields (if registered), liveness, cursor.
    An absent peer URL or message-queue port is ``""`` / ``0``, as LMCache answers them."""
    reg = view.registration
    if reg is None:
        row: dict[str, Any] = {"instance_id": view.instance_id, "alive": False, "registered": False}
    else:
        row = {
            "instance_id": view.instance_id,
            "ip": reg.ip,
            "http_port": reg.http_port,
            "metadata": reg.metadata,
            "p2p_advertised_url": reg.p2p_advertised_url or "",
            "mq_port": reg.mq_port or 0,
            "registration_time": view.registration_time,
            "last_heartbeat_age_s": view.last_heartbeat_age_s,
            "alive": True,
        }
        if reg.p2p_url_signature:  # kvatlas nodes only: LMCache's rows stay as they are
            row["p2p_url_signature"] = reg.p2p_url_signature
        if reg.engine_id:  # kvatlas nodes serving an engine only, likewise
            row["engine_id"] = reg.engine_id
    row.update(emitter_to_wire(view.emitter))
    return row


def instance_from_wire(obj: Any) -> InstanceView:
    """A row of kvatlas's or LMCache's ``GET /instances`` (LMCache lists registered
    instances only, without liveness or cursor fields)."""
    emitter = emitter_from_wire(obj)
    if not _if_sent(_bool, obj, "alive", True):
        return InstanceView(_str(obj, "instance_id"), None, None, None, emitter)
    metadata = _get(obj, "metadata")
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not an object")
    registration = Registration(
        _str(obj, "ip"),
        _opt_int(obj, "http_port"),
        metadata,
        _optional(_str, obj, "p2p_advertised_url") or None,
        _opt_int(obj, "mq_port") or None,
        _if_sent(_str, obj, "p2p_url_signature", None) or None,
        _if_sent(_str, obj, "engine_id", None) or None,
    )
    return InstanceView(
        _str(obj, "instance_id"),
        registration,
        _float(obj, "registration_time"),
        _if_sent(_float, obj, "last_heartbeat_age_s", None),
        emitter,
    )


def instances_to_wire(views: Sequence[InstanceView]) -> dict[str, Any]:
    return {"instances": [instance_to_wire(v) for v in views]}


def instances_from_wire(obj: Any) -> list[InstanceView]:
    return [instance_from_wire(row) for row in _list(obj, "instances")]


def registered_to_wire(instance_id: str, re_registered: bool) -> dict[str, Any]:
    return {"instance_id": instance_id, "re_registered": re_registered}


def heartbeat_to_wire(instance_id: str, *, resync: bool = False) -> dict[str, Any]:
    """``resync: true`` (only when set) asks the instance for a digest exchange."""
    out: dict[str, Any] = {"instance_id": instance_id, "ok": True}
    if resync:
        out["resync"] = True
    return out


def ingest_counts_to_wire(counts: IngestCounts) -> dict[str, Any]:
    """``POST /events``: batches applied, dropped as duplicates, refused as stale."""
    return {"applied": counts.applied, "duplicates": counts.duplicates, "stale": counts.stale}


def health_to_wire(h: HealthView) -> dict[str, Any]:
    out = {
        "status": "healthy",
        "state": h.state.value,
        **h.scheme.describe(),
        "blend_lookup": h.blend_lookup,
        "event_transport": h.event_transport,
        "stream_position": h.stream_position,
        "event_stream": h.event_stream,
        "replica_id": h.replica_id,
        "consumer_group": h.consumer_group,
    }
    if h.kv_events is not None:
        out["kv_events"] = kv_events_to_wire(h.kv_events)
    return out


def kv_events_to_wire(stats: KvEventsStats) -> dict[str, Any]:
    """``{"subscriber": {...}, "publisher": {...}}``, each side only when it runs."""
    sides = {"subscriber": stats.subscriber, "publisher": stats.publisher}
    return {name: dataclasses.asdict(side) for name, side in sides.items() if side is not None}


def readiness_to_wire(state: Readiness) -> dict[str, Any]:
    return {"ready": state is Readiness.SERVING, "state": state.value}
