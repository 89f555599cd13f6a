"""The wire module: every reply it writes reads back to the same value (round trips), the JSON
form has the documented fields in the documented order, and a malformed reply is refused
with ``ValueError`` instead of being half-read."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import pytest

from kvatlas import api
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
from kvatlas.errors import Unprocessable
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


def _fields(row: Any) -> list[str]:
    """A reply's fields in wire order, as the coordinator encodes it."""
    return list(_json_round_trip(row))


@pytest.mark.parametrize(
    ("value", "to_wire"),
    [
        (L1, wire.placement_to_wire),
        (L2, wire.placement_to_wire),
        (KP, wire.lookup_result_to_wire),
        (KeyPlacements(KEY, ()), wire.lookup_result_to_wire),
        (KP, wire.key_entry_to_wire),
        (PREFIX[0], wire.prefix_to_wire),
        (PREFIX[1], wire.prefix_to_wire),
        (TokenLookup(2, [KP, KP], PREFIX), wire.lookup_to_wire),
        (TokenLookup(0, [], []), wire.lookup_to_wire),
        (KeyPage([KP], "c1", None), wire.key_page_to_wire),
        (KeyPage([], None, 7), wire.key_page_to_wire),
        (REGISTERED, wire.instance_to_wire),
        (UNREGISTERED, wire.instance_to_wire),
        (InstanceView("n", Registration(), 1.0, 0.0, NO_EMITTER), wire.instance_to_wire),
        (
            InstanceView(
                "n", dataclasses.replace(REGISTRATION, p2p_url_signature="ab"), 1.0, 0.0, NO_EMITTER
            ),
            wire.instance_to_wire,
        ),
        (
            InstanceView("n", Registration(engine_id="pod-a"), 1.0, 0.0, NO_EMITTER),
            wire.instance_to_wire,
        ),
        ([REGISTERED, UNREGISTERED], wire.instances_to_wire),
    ],
)
def test_round_trip(value: Any, to_wire: Any) -> None:
    """A reply decodes, as its clients decode it, to the value it was encoded from."""
    reply = to_wire(value)
    assert api.decode(msgspec.json.encode(reply), type(reply)) == reply


def test_a_key_reads_back_as_the_object_key() -> None:
    row = api.decode(msgspec.json.encode(wire.key_to_wire(KEY)), api.KeyRow)
    assert ObjectKey.from_wire(row.as_dict()) == KEY
    assert row.as_dict() == KEY.to_wire()


def test_placement_fields_in_wire_order() -> None:
    assert _fields(wire.placement_to_wire(L1)) == [
        "instance_id",
        "incarnation",
        "tier",
        "backend",
        "size_bytes",
        "shared",
        "last_access",
    ]
    assert _fields(wire.prefix_to_wire(PREFIX[0])) == [
        "instance_id",
        "tier",
        "backend",
        "shared",
        "chunks",
    ]
    assert _fields(wire.lookup_to_wire(TokenLookup(0, [], []))) == ["chunks", "results", "prefix"]
    assert _fields(wire.key_page_to_wire(KeyPage([], None))) == [
        "total",
        "keys",
        "next_cursor",
        "next_offset",
    ]
    assert _fields(wire.lookup_result_to_wire(KP)) == [
        "key",
        "placements",
        "token_ids",
        "access_count",
    ]
    assert _fields(wire.key_entry_to_wire(KP)) == [
        "key",
        "placements",
        "num_tokens",
        "access_count",
    ]


def test_instance_rows_registered_and_not() -> None:
    assert _fields(wire.instance_to_wire(REGISTERED)) == [
        "instance_id",
        "ip",
        "http_port",
        "metadata",
        "p2p_advertised_url",
        "mq_port",
        "registration_time",
        "last_heartbeat_age_s",
        "alive",
        "registered",
        "incarnation",
        "last_seq",
        "gaps",
        "missing_batches",
        "events_dropped",
        "seconds_since_last_event",
        "event_delivery_delay_seconds",
    ]
    row = _json_round_trip(wire.instance_to_wire(UNREGISTERED))
    assert row == {  # LMCache's registration fields as its "absent" values (its CLI reads them)
        "instance_id": "node-b",
        "ip": "",
        "http_port": 0,
        "metadata": {},
        "p2p_advertised_url": "",
        "mq_port": 0,
        "registration_time": None,
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
    # `jq .registered` read null for a registered node when the field was left out (issue 29)
    assert _json_round_trip(wire.instance_to_wire(REGISTERED))["registered"] is True


def test_stats_are_lmcache_fields_then_the_directory_stats_then_the_service_fields() -> None:
    directory = KeyDirectory(chunk_size=4).stats()
    out = wire.stats_to_wire(StatsView(directory, "blake3", 3))
    fields = [f.name for f in dataclasses.fields(directory)]
    lmcache = ["num_keys", "num_placements", "l1_keys_by_instance"]
    lmcache += ["l1_count", "l1_size_bytes", "l2_count", "l2_size_bytes"]
    assert list(out) == [*lmcache, *fields, "hash_scheme", "instances_alive"]
    assert out["chunk_size"] == 4 and out["blend"] == {"enabled": False}
    assert out["hash_scheme"] == "blake3" and out["instances_alive"] == 3


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
        b'{"status":"healthy","state":"catching_up","hash_scheme":"blake3","chunk_size":4,'
        b'"enable_blend_lookup":true,"event_transport":"redis","stream_position":"1-0",'
        b'"event_stream":"kv:events","replica_id":"host-1a2b",'
        b'"consumer_group":"kvatlas-host-1a2b"}'
    )
    assert _json_round_trip(wire.readiness_to_wire(Readiness.SERVING)) == {
        "ready": True,
        "state": "serving",
    }
    assert _json_round_trip(wire.readiness_to_wire(Readiness.RESTORING)) == {
        "ready": False,
        "state": "restoring",
    }


def test_readiness_values_are_the_wire_strings() -> None:
    assert [r.value for r in Readiness] == [
        "restoring", "waiting_for_redis", "catching_up", "resyncing", "serving", "group_held",
    ]  # fmt: skip
    ready = [r for r in Readiness if wire.readiness_to_wire(r).ready]
    assert ready == [Readiness.SERVING]
    assert Readiness.SERVING == "serving"


def test_blend_reply() -> None:
    reply = _json_round_trip(wire.blend_to_wire([BlendMatch(b"\x01" * 32, 4, 9)], True))
    assert reply == {
        "matches": [{"chunk_hash": "01" * 32, "old_st": 4, "cur_st": 9}],
        "enable_blend_lookup": True,
    }


@pytest.mark.parametrize(
    "broken",
    [
        None,
        [],
        {},
        {"results": []},  # no chunks
        {"chunks": True, "results": [], "prefix": []},  # a bool is not a count
        {"chunks": 1, "results": {}, "prefix": []},
        {"chunks": 1, "results": [{"key": "k", "placements": []}], "prefix": []},
        {"chunks": 1, "results": [], "prefix": [{"instance_id": 1}]},
    ],
)
def test_malformed_lookup_reply_is_refused(broken: Any) -> None:
    with pytest.raises(Unprocessable):
        api.decode(json.dumps(broken), api.LookupReply, "reply")


def test_malformed_placement_is_refused() -> None:
    good = _json_round_trip(wire.placement_to_wire(L1))
    for name, bad in [
        ("incarnation", "2"),
        ("shared", 0),
        ("last_access", "now"),
        ("size_bytes", False),
        ("tier", None),
    ]:
        with pytest.raises(Unprocessable, match=name):
            api.decode(json.dumps({**good, name: bad}), api.PlacementRow)
    with pytest.raises(Unprocessable, match="backend"):
        api.decode(json.dumps({k: v for k, v in good.items() if k != "backend"}), api.PlacementRow)
    assert api.decode(json.dumps(good), api.PlacementRow) == wire.placement_to_wire(L1)


def test_lookup_placements_are_the_results_placements_in_order() -> None:
    found = TokenLookup(2, [KP, KeyPlacements(KEY, ())], PREFIX)
    reply = api.decode(msgspec.json.encode(wire.lookup_to_wire(found)), api.LookupReply)
    assert [len(r.placements) for r in reply.results] == [2, 0]
    assert reply.results[0].placements == [wire.placement_to_wire(p) for p in KP.placements]
    with pytest.raises(Unprocessable):
        api.decode(b'{"chunks":1,"results":[{"key":{}}]}', api.LookupReply)  # no placements


def test_lmcache_replies_decode_without_kvatlas_fields() -> None:
    """LMCache's rows lack liveness, cursors, ``last_access`` and ``prefix``: defaults."""
    row = api.decode(
        b'{"instance_id":"mp-a","ip":"10.0.0.8","http_port":8081,"registration_time":1.5,'
        b'"metadata":{},"p2p_advertised_url":"","mq_port":0}',
        api.InstanceRow,
    )
    assert row.alive and row.peer_url is None and row.incarnation is None and row.gaps == 0
    assert api.decode(b'{"status":"healthy"}', api.HealthReply).hash_scheme is None
    assert api.decode(b'{"matches":[]}', api.BlendReply).matches == []
