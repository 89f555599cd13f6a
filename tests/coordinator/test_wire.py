"""The wire module: every reply it writes reads back to the same value (round trips), the JSON
form has the documented fields in the documented order, and a malformed reply is refused
with ``ValueError`` instead of being half-read."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import pytest

from kvatlas.coordinator import wire
from kvatlas.coordinator.instances import Registration
from kvatlas.coordinator.views import (
    NO_EMITTER,
    EmitterView,
    HealthView,
    InstanceView,
    Readiness,
    StatsView,
)
from kvatlas.directory import (
    KeyDirectory,
    KeyPage,
    KeyPlacements,
    Placement,
    PrefixHolder,
    TokenLookup,
)
from kvatlas.keys import BlendMatch, KeyScheme, ObjectKey, pack_kv_rank

KEY = ObjectKey(bytes(range(32)), "m", pack_kv_rank(1, 0, 1, 0), 3, "salt")
L1 = Placement("node-a", 2, "l1", "dram", 100, False, 12.5)
L2 = Placement("node-b", 1, "l2", "redis", 100, True, 0.0)
KP = KeyPlacements(KEY, (L1, L2))
PREFIX = [
    PrefixHolder(None, "l2", "redis", True, 3),
    PrefixHolder("node-a", "l1", "dram", False, 1),
]
REGISTRATION = Registration("10.0.0.1", 8000, {"gpu": 0}, "http://10.0.0.1:8001", 5555)
REGISTERED = InstanceView(
    "node-a", REGISTRATION, 1700000000.25, 0.5, EmitterView(2, 7, 1, 3, 4, 2.5, 0.01)
)
UNREGISTERED = InstanceView("node-b", None, None, None, EmitterView(1, 1))


def _json_round_trip(obj: Any) -> Any:
    """What a client gets: the reply encoded as the coordinator encodes it, then parsed."""
    return json.loads(msgspec.json.encode(obj))


@pytest.mark.parametrize(
    ("value", "to_wire", "from_wire"),
    [
        (L1, wire.placement_to_wire, wire.placement_from_wire),
        (L2, wire.placement_to_wire, wire.placement_from_wire),
        (KP, wire.key_placements_to_wire, wire.key_placements_from_wire),
        (KeyPlacements(KEY, ()), wire.key_placements_to_wire, wire.key_placements_from_wire),
        (PREFIX[0], wire.prefix_to_wire, wire.prefix_from_wire),
        (PREFIX[1], wire.prefix_to_wire, wire.prefix_from_wire),
        (TokenLookup(2, [KP, KP], PREFIX), wire.lookup_to_wire, wire.lookup_from_wire),
        (TokenLookup(0, [], []), wire.lookup_to_wire, wire.lookup_from_wire),
        (KeyPage([KP], "c1", None), wire.key_page_to_wire, wire.key_page_from_wire),
        (KeyPage([], None, 7), wire.key_page_to_wire, wire.key_page_from_wire),
        (EmitterView(1, 2, 3, 4, 5, 1.5, 0.5), wire.emitter_to_wire, wire.emitter_from_wire),
        (NO_EMITTER, wire.emitter_to_wire, wire.emitter_from_wire),
        (REGISTERED, wire.instance_to_wire, wire.instance_from_wire),
        (UNREGISTERED, wire.instance_to_wire, wire.instance_from_wire),
        (
            InstanceView("n", Registration(), 1.0, 0.0, NO_EMITTER),
            wire.instance_to_wire,
            wire.instance_from_wire,
        ),
        (
            InstanceView("n", Registration(engine_id="pod-a"), 1.0, 0.0, NO_EMITTER),
            wire.instance_to_wire,
            wire.instance_from_wire,
        ),
        ([REGISTERED, UNREGISTERED], wire.instances_to_wire, wire.instances_from_wire),
    ],
)
def test_round_trip(value: Any, to_wire: Any, from_wire: Any) -> None:
    assert from_wire(_json_round_trip(to_wire(value))) == value


def test_placement_fields_in_wire_order() -> None:
    assert list(wire.placement_to_wire(L1)) == [
        "instance_id",
        "incarnation",
        "tier",
        "backend",
        "size_bytes",
        "shared",
        "last_access",
    ]
    assert list(wire.prefix_to_wire(PREFIX[0])) == [
        "instance_id",
        "tier",
        "backend",
        "shared",
        "chunks",
    ]
    assert list(wire.lookup_to_wire(TokenLookup(0, [], []))) == ["chunks", "results", "prefix"]
    assert list(wire.key_page_to_wire(KeyPage([], None))) == [
        "total",
        "keys",
        "next_cursor",
        "next_offset",
    ]
    assert list(wire.lookup_result_to_wire(KP)) == [
        "key",
        "placements",
        "token_ids",
        "access_count",
    ]
    assert list(wire.key_entry_to_wire(KP)) == ["key", "placements", "num_tokens", "access_count"]


def test_instance_rows_registered_and_not() -> None:
    assert list(wire.instance_to_wire(REGISTERED)) == [
        "instance_id",
        "ip",
        "http_port",
        "metadata",
        "p2p_advertised_url",
        "mq_port",
        "registration_time",
        "last_heartbeat_age_s",
        "alive",
        "incarnation",
        "last_seq",
        "gaps",
        "missing_batches",
        "events_dropped",
        "seconds_since_last_event",
        "event_delivery_delay_seconds",
    ]
    row = wire.instance_to_wire(UNREGISTERED)
    assert row == {
        "instance_id": "node-b",
        "alive": False,
        "registered": False,
        "incarnation": 1,
        "last_seq": 1,
        "gaps": 0,
        "missing_batches": 0,
        "events_dropped": 0,
        "seconds_since_last_event": None,
        "event_delivery_delay_seconds": None,
    }
    assert REGISTERED.alive and not UNREGISTERED.alive


def test_stats_are_lmcache_fields_then_the_directory_stats_then_the_service_fields() -> None:
    directory = KeyDirectory(chunk_size=4).stats()
    out = wire.stats_to_wire(StatsView(directory, "blake3", 3))
    fields = [f.name for f in dataclasses.fields(directory)]
    lmcache = ["num_keys", "num_placements", "l1_keys_by_instance"]
    lmcache += ["l1_count", "l1_size_bytes", "l2_count", "l2_size_bytes"]
    assert list(out) == [*lmcache, *fields, "key_scheme", "instances_alive"]
    assert out["chunk_size"] == 4 and out["blend"] == {"enabled": False}
    assert out["key_scheme"] == "blake3" and out["instances_alive"] == 3


def test_directory_stats_with_blend_on_carry_the_index_stats() -> None:
    directory = KeyDirectory(chunk_size=4, enable_blend_lookup=True).stats()
    out = wire.directory_stats_to_wire(directory)
    assert directory.blend is not None
    assert out["blend"] == {"enabled": True, **dataclasses.asdict(directory.blend)}
    lmcache = wire.stats_to_wire(StatsView(directory, "blake3", 0))["blend"]
    assert lmcache == {
        "enabled": True,
        "num_contents": directory.blend.contents,
        "num_chunks": directory.blend.occupants,
        "num_claims": directory.blend.claims,
        "num_namespaces": directory.blend.namespaces,
        "table_size": directory.blend.table_slots,
        **dataclasses.asdict(directory.blend),
    }


def test_health_and_readiness() -> None:
    health = HealthView(
        Readiness.CATCHING_UP,
        KeyScheme("blake3", 4),
        True,
        "redis",
        "1-0",
        "kv:events",
        "host-1a2b",
        "kvatlas-host-1a2b",
    )
    assert msgspec.json.encode(wire.health_to_wire(health)) == (
        b'{"status":"healthy","state":"catching_up","key_scheme":"blake3","chunk_size":4,'
        b'"blend_lookup":true,"event_transport":"redis","stream_position":"1-0",'
        b'"event_stream":"kv:events","replica_id":"host-1a2b",'
        b'"consumer_group":"kvatlas-host-1a2b"}'
    )
    assert wire.readiness_to_wire(Readiness.SERVING) == {"ready": True, "state": "serving"}
    assert wire.readiness_to_wire(Readiness.RESTORING) == {"ready": False, "state": "restoring"}


def test_readiness_values_are_the_wire_strings() -> None:
    assert [r.value for r in Readiness] == [
        "restoring", "waiting_for_redis", "catching_up", "resyncing", "serving", "group_held",
    ]  # fmt: skip
    ready = [r for r in Readiness if wire.readiness_to_wire(r)["ready"]]
    assert ready == [Readiness.SERVING]
    assert Readiness.SERVING == "serving"


def test_blend_reply() -> None:
    reply = wire.blend_to_wire([BlendMatch(b"\x01" * 32, 4, 9)], True)
    assert reply == {
        "matches": [{"chunk_hash": "01" * 32, "old_st": 4, "cur_st": 9}],
        "blend_enabled": True,
    }


@pytest.mark.parametrize(
    "broken",
    [
        None,
        [],
        {},
        {"chunks": 1, "results": []},  # no prefix
        {"chunks": True, "results": [], "prefix": []},  # a bool is not a count
        {"chunks": 1, "results": {}, "prefix": []},
        {"chunks": 1, "results": [{"key": "k", "placements": []}], "prefix": []},
        {"chunks": 1, "results": [], "prefix": [{"instance_id": 1}]},
    ],
)
def test_malformed_lookup_reply_is_refused(broken: Any) -> None:
    with pytest.raises(ValueError):
        wire.lookup_from_wire(broken)


def test_malformed_placement_is_refused() -> None:
    good = wire.placement_to_wire(L1)
    for name, bad in [
        ("incarnation", "2"),
        ("shared", 0),
        ("last_access", "now"),
        ("size_bytes", False),
        ("tier", None),
    ]:
        with pytest.raises(ValueError, match=name):
            wire.placement_from_wire({**good, name: bad})
    with pytest.raises(ValueError, match="backend"):
        wire.placement_from_wire({k: v for k, v in good.items() if k != "backend"})


def test_bad_key_in_reply_is_refused() -> None:
    row = _json_round_trip(wire.key_placements_to_wire(KP))
    row["key"]["chunk_hash_hex"] = "zz"
    with pytest.raises(ValueError):
        wire.key_placements_from_wire(row)


def test_lookup_placements_are_the_results_placements_in_order() -> None:
    found = TokenLookup(2, [KP, KeyPlacements(KEY, ())], PREFIX)
    body = json.loads(json.dumps(wire.lookup_to_wire(found)))
    assert wire.lookup_placements_from_wire(body) == [KP.placements, ()]
    with pytest.raises(ValueError):
        wire.lookup_placements_from_wire({"results": [{"key": {}}]})  # no placements
