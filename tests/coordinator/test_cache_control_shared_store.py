"""The shared (Redis) cache-control tables against the in-memory ones as oracles, on a real
redis-server (``kvatlas/coordinator/cache_control/shared_*.py``): random sequences of pins and
unpins, quota changes and command transitions leave both answering the same; LMCache's golden
cache-control exchanges replay through a :class:`CacheControl` over Redis with LMCache's
replies; a change made concurrently by another replica is re-applied, not lost; a finished
command stays finished; a lease is one replica's until it lapses."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.cache_control import CacheControl, CommandLog, PinTable, QuotaTable
from kvatlas.coordinator.cache_control.shared_commands import SharedCommandLog
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.coordinator.cache_control.shared_tables import SharedPinTable, SharedQuotaTable
from kvatlas.keys import ObjectKey
from tests.conftest import RedisServer, wait_for
from tests.coordinator.test_cache_control_model import GOLDEN, replay

_prefixes = itertools.count()
KEYS = [
    ObjectKey(bytes([i]) * 32, model, 16777472, 0, salt)
    for i, (model, salt) in enumerate(itertools.product(("m", "n"), ("", "a", "b")))
]
SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def new_store(
    redis_server: RedisServer, stream: str | None = None, owner: str = "a"
) -> SharedStore:
    stream = stream or f"kvatlas:shared-test-{next(_prefixes)}"
    return SharedStore.connect(redis_server.url, stream, owner)


# ------------------------------------------------------------------ pins and quotas


pin_ops = st.lists(
    st.tuples(st.sampled_from(["pin", "unpin"]), st.lists(st.sampled_from(KEYS), max_size=4)),
    max_size=12,
)


@SETTINGS
@given(ops=pin_ops)
def test_shared_pins_answer_as_the_in_memory_table(
    redis_server: RedisServer, ops: list[tuple[str, list[ObjectKey]]]
) -> None:
    store = new_store(redis_server)
    try:
        shared, oracle = SharedPinTable(store), PinTable()
        for op, keys in ops:
            assert getattr(shared, op)(keys) == getattr(oracle, op)(keys)
        assert shared.rows() == oracle.rows()  # counts and first-pinned order
        for salt, model in itertools.product((None, "", "a"), (None, "m")):
            assert shared.page(salt, model, 1, 2) == oracle.page(salt, model, 1, 2)
        assert shared.page(None, None, 0, 100, salts={"b"}) == oracle.page(
            None, None, 0, 100, salts={"b"}
        )
        assert shared.pinned(KEYS) == oracle.pinned(KEYS)
        assert [shared.count(k) for k in KEYS] == [oracle.count(k) for k in KEYS]
    finally:
        store.client.close()


replica_pin_ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["pin", "unpin"]), st.lists(st.sampled_from(KEYS), max_size=4)),
        st.tuples(st.just("read"), st.just([])),  # the other replica reads (its delta path)
    ),
    max_size=16,
)


@SETTINGS
@given(
    seeded=st.lists(st.sampled_from(KEYS), max_size=3, unique=True),
    ops=replica_pin_ops,
    log_weight=st.sampled_from([3, 8, 1000]),
)
@example(seeded=[], ops=[("pin", KEYS[:1])], log_weight=1000)  # B's copy: an unchanged Redis
def test_a_replicas_copy_of_the_pins_follows_the_changes_as_a_full_read_would(
    redis_server: RedisServer,
    seeded: list[ObjectKey],
    ops: list[tuple[str, list[ObjectKey]]],
    log_weight: int,
) -> None:
    """Replica B's copy of the pins, brought up to date from the log of changes replica A
    made (``pins:log``), answers as a full read of Redis (the oracle: a fresh table) after
    every read, with changes in between of any size and a log small enough to be trimmed
    past B's copy (B then reads every pin), after a seed (not logged: B reads every pin).
    Otherwise B reads every pin once, at its first read."""
    stream = f"kvatlas:shared-test-{next(_prefixes)}"
    a_store, b_store = new_store(redis_server, stream, "a"), new_store(redis_server, stream, "b")
    try:
        a = SharedPinTable(a_store, log_weight=log_weight)
        b = SharedPinTable(b_store, log_weight=log_weight)
        b.rows()  # B's first read: every pin (none)
        a.seed([(k, 2) for k in seeded])  # a snapshot seeding an empty Redis
        for op, keys in ops:
            if op == "read":
                oracle = SharedPinTable(a_store)
                assert b.rows() == oracle.rows()
                assert b.pinned(KEYS) == oracle.pinned(KEYS)
                assert [b.count(k) for k in KEYS] == [oracle.count(k) for k in KEYS]
            else:
                getattr(a, op)(keys)
        assert b.rows() == SharedPinTable(a_store).rows()
        if log_weight == 1000 and b.full_reads > 1:
            assert seeded and b.full_reads == 2  # the seed's
    finally:
        a_store.client.close()
        b_store.client.close()


def test_a_copy_of_the_pins_is_read_anew_after_redis_lost_its_data(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis loses its data (a restart without persistence) and counts versions from 0 again:
    a replica whose copy was at version N must not apply the new Redis's changes N+1… on top
    of the old copy. (The old code: B kept the lost pins and missed the new ones 1…N.) No
    replica here holds a copy to seed with, so A's change does not wait for one."""
    from kvatlas.coordinator.cache_control import shared_store

    monkeypatch.setattr(shared_store, "NO_COPY_WAIT_S", 0.0)
    stream = f"kvatlas:shared-test-{next(_prefixes)}"
    a_store, b_store = new_store(redis_server, stream, "a"), new_store(redis_server, stream, "b")
    try:
        a, b = SharedPinTable(a_store), SharedPinTable(b_store)
        for key in KEYS[:3]:
            a.pin([key])  # versions 1..3
        assert b.pinned(KEYS) == set(KEYS[:3])  # B's copy: version 3
        a_store.client.delete(*a_store.client.keys(f"{stream}:*"))  # the data lost
        for key in KEYS[3:]:
            a.pin([key])  # versions 1..3 again, then 4..6: contiguous after B's 3
        assert b.rows() == SharedPinTable(a_store).rows() == [(k, 1) for k in KEYS[3:]]
    finally:
        a_store.client.close()
        b_store.client.close()


quota_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(["", "a", "b"]), st.floats(0, 100)),
        st.tuples(st.just("remove"), st.sampled_from(["", "a", "b"])),
        st.tuples(st.just("set_default"), st.one_of(st.none(), st.floats(0, 100))),
    ),
    max_size=10,
)


@SETTINGS
@given(ops=quota_ops)
def test_shared_quotas_answer_as_the_in_memory_table(
    redis_server: RedisServer, ops: list[tuple[object, ...]]
) -> None:
    store = new_store(redis_server)
    try:
        shared, oracle = SharedQuotaTable(store), QuotaTable()
        for op, *args in ops:
            assert getattr(shared, str(op))(*args) == getattr(oracle, str(op))(*args)
        assert shared.limits() == oracle.limits()
        assert shared.default_limit_gb == oracle.default_limit_gb
        for salt in ("", "a", "b", "c"):
            assert shared.own(salt) == oracle.own(salt)
            assert shared.effective_gb(salt) == oracle.effective_gb(salt)
            assert shared.over_limit(salt, 1 << 30) == oracle.over_limit(salt, 1 << 30)
    finally:
        store.client.close()


def test_golden_exchanges_replay_through_the_shared_tables(redis_server: RedisServer) -> None:
    """LMCache's 36 cache-control exchanges, through a CacheControl whose pins, quotas and
    commands are in Redis: LMCache's statuses and, for every 200, LMCache's exact reply."""
    golden = json.loads(GOLDEN.read_text())
    store = new_store(redis_server)
    instances: set[str] = set()
    control = CacheControl(
        golden["chunk_size"], is_instance=instances.__contains__, usage_by_salt=dict,
        pins=SharedPinTable(store), quotas=SharedQuotaTable(store),
        commands=SharedCommandLog(store), store=store,
    )  # fmt: skip
    problems = []
    try:
        for i, e in enumerate(golden["exchanges"]):
            status, got, _command = replay(control, instances, e)
            where = f"#{i} {e['method']} {e['path']} ({e['note']})"
            if status != e["lmcache_status"]:
                problems.append(f"{where}: status {status}, LMCache {e['lmcache_status']}: {got}")
            elif status == 200 and got != e["lmcache_response"]:
                problems.append(f"{where}: {got} != LMCache's {e['lmcache_response']}")
    finally:
        store.client.close()
    assert problems == []


# ------------------------------------------------------------------ commands


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


COMMAND_OPS = ["new", "delivery_failed", "due_now", "delivered", "completed", "failed"]
COMMAND_OPS += ["progress", "tick"]
command_ops = st.lists(st.tuples(st.sampled_from(COMMAND_OPS), st.integers(0, 5)), max_size=25)


@SETTINGS
@given(ops=command_ops)
def test_the_shared_command_log_answers_as_the_in_memory_log(
    redis_server: RedisServer, ops: list[tuple[str, int]]
) -> None:
    store = new_store(redis_server)
    clock = Clock()
    options = {"clock": clock, "jitter": lambda: 0.5, "retention_s": 50.0}
    shared, oracle = SharedCommandLog(store, **options), CommandLog(**options)  # type: ignore[arg-type]
    ids: list[str] = []
    try:
        for op, n in ops:
            if op == "tick":
                clock.now += 7.0 * (n + 1)
                assert shared.prune() == oracle.prune()
                continue
            if op == "new":
                c = oracle.new("delete", [f"i{n}"], [], tier="l1")
                assert shared.record(c) == c
                ids.append(c.command_id)
                continue
            open_ids = [c.command_id for c in oracle.unfinished()]
            if not open_ids:
                continue
            target = open_ids[n % len(open_ids)]  # only unfinished commands change
            for log in (shared, oracle):
                if op in ("completed", "failed"):
                    log.finish(target, op, error=f"e{n}")  # type: ignore[arg-type]
                elif op == "progress":
                    log.progress(target, found_keys=n)
                elif op == "delivered":
                    log.delivered(target, (f"r{n}",))
                else:
                    getattr(log, op)(target, *(["down"] if op == "delivery_failed" else []))
        for i in ids:
            assert shared.get(i) == oracle.get(i)
        assert shared.unfinished() == oracle.unfinished()
        assert shared.due() == oracle.due()
        assert shared.counts() == oracle.counts()
        restored = CommandLog.from_snapshot(shared.to_snapshot())
        assert sorted(c.command_id for c in restored.unfinished()) == sorted(
            c.command_id for c in oracle.unfinished()
        )
    finally:
        store.client.close()


def test_a_concurrent_change_by_another_replica_is_reapplied_not_lost(
    redis_server: RedisServer,
) -> None:
    stream = f"kvatlas:shared-test-{next(_prefixes)}"
    a_store, b_store = new_store(redis_server, stream, "a"), new_store(redis_server, stream, "b")
    a, b = SharedCommandLog(a_store), SharedCommandLog(b_store)
    try:
        c = a.new("delete", ["n1"], [], tier="l1")
        calls = []

        def deliver(current: object) -> object:
            calls.append(current)
            if len(calls) == 1:  # B's write lands between A's read and A's write
                b.progress(c.command_id, last_error="seen by b")
            return msgspec.structs.replace(current, state="sent")  # type: ignore[type-var]

        after = a.update(c.command_id, deliver)  # type: ignore[arg-type]
        assert len(calls) == 2  # A read again and re-applied its change
        assert (after.state, after.last_error) == ("sent", "seen by b")
        assert b.get(c.command_id) == after
        # a finished command stays finished: a stale copy written later does not revive it
        a.finish(c.command_id, "completed")
        assert b.record(msgspec.structs.replace(c, state="pending")).state == "completed"
        assert b.get(c.command_id).state == "completed"  # type: ignore[union-attr]
        assert b.unfinished() == [] and b.counts() == {("delete", "completed"): 1}
    finally:
        a_store.client.close()
        b_store.client.close()


def test_a_lease_is_one_replicas_until_it_lapses(redis_server: RedisServer) -> None:
    stream = f"kvatlas:shared-test-{next(_prefixes)}"
    a_store, b_store = new_store(redis_server, stream, "a"), new_store(redis_server, stream, "b")
    a, b = SharedCommandLog(a_store, lease_s=0.3), SharedCommandLog(b_store, lease_s=0.3)
    try:
        c = a.new("delete", ["n1"], [], tier="l1")
        assert a.claim([c.command_id]) == {c.command_id}
        assert b.claim([c.command_id]) == set()  # A holds it
        assert a.claim([c.command_id]) == {c.command_id}  # renewed by its holder
        assert a.leads("eviction") and not b.leads("eviction")
        # A stops renewing (it died): B takes both over once the leases lapse
        assert wait_for(lambda: b.claim([c.command_id]) == {c.command_id}, timeout=10)
        assert wait_for(lambda: b.leads("eviction"), timeout=10)
        assert a.claim([c.command_id]) == set() and not a.leads("eviction")
        b.release([c.command_id])  # let go (its instance is not registered with B)
        assert a.claim([c.command_id]) == {c.command_id}  # at once, no lapse to wait for
        b.release([c.command_id])  # not B's any more: nothing happens
        assert b.claim([c.command_id]) == set()
    finally:
        a_store.client.close()
        b_store.client.close()


def test_a_finished_commands_state_never_changes_in_either_log(redis_server: RedisServer) -> None:
    """A failed command stays failed: a late delivery failure does not make it pending again,
    a late delivery does not make it sent, a late completion does not make it completed (a
    worker's attempt that ran on while an instance left), in the in-memory log and in Redis."""
    store = new_store(redis_server)
    try:
        for log in (CommandLog(), SharedCommandLog(store)):
            c = log.new("delete", ["n1"], [], tier="l1")
            log.finish(c.command_id, "failed", "instance 'n1' deregistered")
            assert log.delivery_failed(c.command_id, "down").state == "failed"
            assert log.delivered(c.command_id).state == "failed"
            assert log.finish(c.command_id, "completed").state == "failed"
            got = log.get(c.command_id)
            assert got is not None and (got.state, got.last_error) == (
                "failed",
                "instance 'n1' deregistered",
            )
            assert log.unfinished() == [] and log.counts() == {("delete", "failed"): 1}
    finally:
        store.client.close()
