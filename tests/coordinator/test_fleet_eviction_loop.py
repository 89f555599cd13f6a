"""The fleet eviction pass carried out (``kvatlas/coordinator/cache_control/eviction_loop.py``,
issue 30 item 4): which ``evict`` commands a pass records, to whom, and how the delivery loop
carries them, with the directory, the fleet and the MP servers as fakes (milliseconds each);
the directory's pass (``keys_of_salts``) on a real ``KeyDirectory``. Real processes:
``test_cache_control_delivery.py::test_a_zero_quota_evicts_every_unpinned_l2_key``."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvatlas.coordinator.cache_control import CacheControl, CommandLog
from kvatlas.coordinator.cache_control.delivery import Delivery, object_key
from kvatlas.coordinator.cache_control.delivery_contract import Copy
from kvatlas.coordinator.cache_control.eviction import (
    EvictionPolicy,
    KeyFacts,
    SaltState,
    limit_bytes_of,
    plan,
)
from kvatlas.coordinator.cache_control.eviction_loop import FleetEviction
from kvatlas.coordinator.cache_control.metrics import CacheControlCollector
from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.directory import KeyDirectory
from kvatlas.directory.salt_usage import Holder, SaltKey
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.coordinator.test_cache_control_routing_of_commands import FakeFleet, FakeServers
from tests.directory.helpers import CS, Emitter, entry, key, toks

MIB = 1 << 20
NOW = 1_000.0


def okey(n: int, salt: str) -> ObjectKey:
    return ObjectKey(n.to_bytes(32, "big"), "m", pack_kv_rank(1, 0, 1, 0), 0, salt)


def private(*instances: str) -> tuple[Holder, ...]:
    return tuple(Holder(i, False, "fs") for i in instances)


@dataclass
class FakeDirectory:
    keys: dict[str, list[SaltKey]] = field(default_factory=dict)
    asked: list[set[str]] = field(default_factory=list)

    def bytes_by_salt(self, tier: str = "l2") -> dict[str, int]:
        return {s: sum(k.size_bytes for k in ks) for s, ks in self.keys.items() if ks}

    def keys_of_salts(self, salts: Collection[str], tier: str = "l2") -> dict[str, list[SaltKey]]:
        self.asked.append(set(salts))
        return {s: list(self.keys[s]) for s in salts if s in self.keys}


def salt_keys(salt: str, n: int, holders: tuple[Holder, ...] = private("a")) -> list[SaltKey]:
    """``n`` keys of 1 MiB, key ``i`` last accessed at ``NOW - 100 + i`` (key 0 the oldest)."""
    return [SaltKey(okey(i, salt), MIB, NOW - 100 + i, i, holders) for i in range(n)]


def setup(
    policy: EvictionPolicy = EvictionPolicy.LRU,
) -> tuple[CacheControl, FakeDirectory, FleetEviction]:
    control = CacheControl(16, is_instance=lambda i: True, usage_by_salt=dict,
                           commands=CommandLog(jitter=lambda: 1.0))  # fmt: skip
    directory = FakeDirectory()
    return control, directory, FleetEviction(lambda: control, directory, policy, clock=lambda: NOW)


def evicted(control: CacheControl) -> dict[str, set[ObjectKey]]:
    """The keys of every recorded ``evict`` command, by target."""
    out: dict[str, set[ObjectKey]] = {}
    for c in control.commands.unfinished():
        assert c.kind == "evict" and c.tier == "l2" and not c.force
        out.setdefault(c.targets[0], set()).update(object_key(k) for k in c.keys)
    return out


def planned(
    control: CacheControl, salt: str, keys: list[SaltKey], policy: EvictionPolicy
) -> set[ObjectKey]:
    """What the planner alone says for the salt (the pass must record exactly these)."""
    pinned = control.pins.pinned(k.key for k in keys)
    facts = [KeyFacts(k.key, k.size_bytes, k.last_access, 1, k.position, k.key in pinned)
             for k in keys]  # fmt: skip
    state = SaltState.of(salt, sum(k.size_bytes for k in keys),
                         limit_bytes_of(control.quotas, salt), facts)  # fmt: skip
    return {k for e in plan(policy, [state], NOW) for k in e.keys}


def test_a_salt_over_its_quota_gets_evict_commands_for_exactly_the_planners_keys() -> None:
    control, directory, eviction = setup()
    directory.keys["t"] = keys = salt_keys("t", 10)
    control.quotas.set("t", 8.5 * MIB / GB)  # 10 MiB held: over
    control.pins.pin([keys[0].key])  # the oldest: LRU's first choice, but pinned
    recorded = eviction.run_once()
    want = planned(control, "t", keys, EvictionPolicy.LRU)
    assert want == {keys[1].key, keys[2].key}  # LMCache's count: a fifth of 10 keys, LRU first
    assert evicted(control) == {"a": want} and len(recorded) == 1
    assert eviction.evicted_bytes() == {("t", "lru"): 2 * MIB}
    # the next pass counts those keys as gone (8 MiB < 8.5 MiB): nothing more is recorded
    assert eviction.run_once() == []


def test_every_holder_gets_the_keys_it_holds_and_a_shared_copy_goes_to_its_reporter() -> None:
    control, directory, eviction = setup()
    shared = (Holder("b", True, "pool"),)
    directory.keys["t"] = [
        SaltKey(okey(0, "t"), 2 * MIB, NOW - 9, 0, private("a", "b")),  # two private L2s
        SaltKey(okey(1, "t"), MIB, NOW - 8, 1, shared),
        SaltKey(okey(2, "t"), MIB, NOW - 1, 2, private("a")),
    ]
    control.quotas.set("t", 0.0)  # 0: every unpinned key goes
    eviction.run_once()
    assert evicted(control) == {
        "a": {okey(0, "t"), okey(2, "t")},
        "b": {okey(0, "t"), okey(1, "t")},
    }
    assert eviction.evicted_bytes() == {("t", "lru"): 4 * MIB}


def test_a_zero_limit_evicts_every_unpinned_key_and_never_a_pinned_one() -> None:
    for policy in EvictionPolicy:
        control, directory, eviction = setup(policy)
        directory.keys["z"] = keys = salt_keys("z", 7)
        control.quotas.set("z", 0.0)
        control.pins.pin([keys[3].key, keys[6].key])
        eviction.run_once()
        assert evicted(control) == {"a": {k.key for k in keys} - {keys[3].key, keys[6].key}}
        assert eviction.evicted_bytes() == {("z", policy.value): 5 * MIB}


def test_exempt_salts_and_salts_under_their_limit_get_nothing() -> None:
    control, directory, eviction = setup()
    directory.keys["free"] = salt_keys("free", 50)  # no quota, default null: exempt
    directory.keys["under"] = salt_keys("under", 3)
    control.quotas.set("under", 1.0)  # 1 GiB, 3 MiB held
    assert eviction.run_once() == [] and directory.asked == []  # no key pass at all
    control.quotas.set_default(0.0)  # now the salts without a quota may hold nothing
    eviction.run_once()
    assert evicted(control) == {"a": {k.key for k in directory.keys["free"]}}
    assert directory.asked == [{"free"}]


def test_the_value_policy_evicts_down_to_the_limit_with_its_reason() -> None:
    control, directory, eviction = setup(EvictionPolicy.VALUE)
    directory.keys["v"] = keys = salt_keys("v", 10)
    control.quotas.set("v", 6.5 * MIB / GB)
    eviction.run_once()
    got = evicted(control)["a"]
    assert got == planned(control, "v", keys, EvictionPolicy.VALUE) and len(got) == 4
    assert eviction.evicted_bytes() == {("v", "value"): 4 * MIB}


def test_the_delivery_loop_runs_the_pass_every_period_and_finishes_evictions_like_deletes() -> None:
    control, directory, _ = setup()
    clock = [NOW]
    eviction = FleetEviction(lambda: control, directory, EvictionPolicy.LRU, clock=lambda: clock[0])
    fleet = FakeFleet(urls={"a": "http://a"})
    servers = FakeServers(fleet)
    delivery = Delivery(lambda: control.commands, fleet, servers)
    delivery.eviction = eviction.maybe_run
    delivery.pinned = control.pins.pinned
    directory.keys["t"] = keys = salt_keys("t", 5)
    fleet.held = {k.key: [Copy("a", "l2", "fs", False)] for k in keys}
    control.quotas.set("t", 0.0)
    control.pins.pin([keys[4].key])
    delivery.run_once()
    assert servers.calls == [("http://a", "delete", "l2")]  # the pass ran, then delivered
    (c,) = control.commands.unfinished()
    assert c.state == "sent" and {object_key(k) for k in c.keys} == {k.key for k in keys[:4]}
    for k in keys[:4]:  # the node's delete events
        del fleet.held[k.key]
    directory.keys["t"] = keys[4:]
    delivery.run_once()
    assert control.commands.get(c.command_id).state == "completed"  # type: ignore[union-attr]
    directory.keys["t"] = salt_keys("t", 5)  # stored again within the period: no pass yet
    delivery.run_once()
    assert control.commands.unfinished() == []
    clock[0] += eviction.config.pass_interval_s
    delivery.run_once()
    assert len(control.commands.unfinished()) == 1


def test_a_key_pinned_after_the_pass_is_left_out_of_the_delivery() -> None:
    control, directory, eviction = setup()
    fleet = FakeFleet(urls={"a": "http://a"})
    servers = FakeServers(fleet)
    delivery = Delivery(lambda: control.commands, fleet, servers)
    delivery.pinned = control.pins.pinned
    directory.keys["t"] = keys = salt_keys("t", 3)
    control.quotas.set("t", 0.0)
    (c,) = eviction.run_once()
    control.pins.pin([keys[1].key])  # pinned while the command waits
    delivery.run_once()
    sent = control.commands.get(c.command_id)
    assert sent is not None and sent.state == "sent"
    assert {object_key(k) for k in sent.keys} == {keys[0].key, keys[2].key}
    only_pinned = control.commands.new("evict", ["a"], c.keys[1:2], tier="l2")
    servers.calls.clear()
    delivery.run_once()
    assert servers.calls == []  # nothing sent: its only key is pinned
    assert control.commands.get(only_pinned.command_id).state == "completed"  # type: ignore[union-attr]


def test_metrics_show_usage_ratio_and_evicted_bytes_by_salt_and_reason() -> None:
    control, directory, eviction = setup()
    directory.keys["t"] = salt_keys("t", 10)
    directory.keys["free"] = salt_keys("free", 1)
    control.quotas.set("t", 8.5 * MIB / GB)
    eviction.run_once()
    registry = CollectorRegistry()
    registry.register(CacheControlCollector(lambda: control, lambda keys: 0, eviction))
    value = registry.get_sample_value
    assert value("kvatlas_cache_evicted_bytes_total", {"cache_salt": "t", "reason": "lru"}) == (
        2 * MIB
    )
    assert value("kvatlas_quota_usage_bytes", {"cache_salt": "t"}) == 10 * MIB
    assert value("kvatlas_quota_usage_ratio", {"cache_salt": "t"}) == 10 / 8.5
    assert value("kvatlas_quota_usage_bytes", {"cache_salt": "free"}) == MIB
    assert value("kvatlas_quota_usage_ratio", {"cache_salt": "free"}) is None  # exempt


def test_the_directory_pass_gives_each_salts_l2_keys_with_their_facts() -> None:
    d = KeyDirectory(CS)
    a, b = Emitter("a"), Emitter("b")
    k1, k2, other = key(1, salt="t"), key(2, salt="t"), key(3, salt="u")
    d.consume(a.batch("store", [entry(k1, size=5)], tier="l2", backend="fs", ts=3.0))
    d.consume(b.batch("store", [entry(k1, size=6)], tier="l2", backend="fs", ts=4.0))
    d.consume(a.batch("store", [entry(k1, size=7)], ts=9.0))  # L1: not counted, but a use
    d.consume(a.batch("store", [entry(k2, toks(1, 2, 3, 4), offset=8, size=2)], tier="l2",
                      backend="pool", shared=True, ts=1.0))  # fmt: skip
    d.consume(a.batch("store", [entry(other, size=1)], tier="l2", backend="fs"))
    d.consume(a.batch("store", [entry(key(4, salt="t"), size=1)]))  # L1 only: not an L2 key
    got = d.keys_of_salts({"t"})
    assert set(got) == {"t"}
    by_key = {k.key: k for k in got["t"]}
    assert set(by_key) == {k1, k2}
    assert (by_key[k1].size_bytes, by_key[k1].last_access) == (11, 9.0)
    assert set(by_key[k1].holders) == {Holder("a", False, "fs"), Holder("b", False, "fs")}
    assert (by_key[k2].size_bytes, by_key[k2].position) == (2, 8 // CS)
    assert by_key[k2].holders == (Holder("a", True, "pool"),)
    assert d.bytes_by_salt() == {"t": 13, "u": 1}
    assert d.keys_of_salts(set()) == {}
