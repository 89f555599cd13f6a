"""Where the delivery loop sends a command and when it finishes it
(``kvatlas/coordinator/cache_control/delivery.py``), with the fleet and the MP servers as
fakes: every case runs in milliseconds. Real processes: ``test_cache_control_delivery.py``."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest

from kvatlas.api.cache_control import (
    DeleteObjectsReply,
    EncodedKey,
    HoldReply,
    PrefetchStatusReply,
    PrefetchSubmitted,
    ReleaseReply,
    TierName,
)
from kvatlas.coordinator.cache_control import Command, CommandLog, moves
from kvatlas.coordinator.cache_control.delivery import Delivery, object_key
from kvatlas.coordinator.cache_control.delivery_contract import Copy, MpServer
from kvatlas.coordinator.cache_control.shared_commands import SharedCommandLog
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.errors import Unavailable
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.conftest import RedisServer

KEYS = [EncodedKey(f"{n:064x}", "m", pack_kv_rank(1, 0, 1, 0)) for n in (1, 2)]


class Refused(Unavailable):
    def __init__(self, message: str, reply_status: int | None) -> None:
        super().__init__(message)
        self.reply_status = reply_status


@dataclass
class FakeFleet:
    urls: dict[str, str] = field(default_factory=dict)  # registered instances
    elsewhere: set[str] = field(default_factory=set)  # registered with another replica
    pools: dict[str, set[str]] = field(default_factory=dict)  # instance -> shared backends
    held: dict[ObjectKey, list[Copy]] = field(default_factory=dict)
    starting: bool = False  # not every live instance has had its timeout to register yet

    def url_of(self, instance_id: str) -> str | None:
        return self.urls.get(instance_id)

    def gone(self, instance_id: str) -> bool:
        return not (self.starting or instance_id in self.urls or instance_id in self.elsewhere)

    def registered_elsewhere(self, instance_id: str) -> bool:
        return instance_id in self.elsewhere and instance_id not in self.urls

    def pool_members(self, backend: str) -> list[str]:
        return sorted(i for i, b in self.pools.items() if backend in b and i in self.urls)

    def pools_of(self, instance_id: str) -> set[str]:
        return self.pools.get(instance_id, set())

    def copies(self, keys: Sequence[ObjectKey]) -> list[list[Copy]]:
        return [list(self.held.get(k, [])) for k in keys]


@dataclass
class FakeServers:
    """MP servers by URL: ``down`` ones cannot be reached, ``refuse`` ones answer 400."""

    fleet: FakeFleet
    down: set[str] = field(default_factory=set)
    refuse: set[str] = field(default_factory=set)
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (url, call, tier)
    statuses: dict[str, PrefetchStatusReply | None] = field(default_factory=dict)
    holds: list[EncodedKey] | None = None  # what a move's target holds (None: every key)
    unfinished: list[int] = field(default_factory=list)  # a hold's unfinished, call by call
    deleted: list[list[EncodedKey]] = field(default_factory=list)  # the keys of each delete
    deleting: Callable[[str, Sequence[EncodedKey], str], DeleteObjectsReply | None] | None = None
    """Called with each delete that reached its server (URL, keys, tier): a reply of its own
    (nothing recorded in ``deleted``), or ``None`` for the usual one."""

    def __call__(self, url: str) -> MpServer:
        servers = self

        class One:
            def _check(self, name: str, tier: str) -> None:
                servers.calls.append((url, name, tier))
                if url in servers.down:
                    raise Refused("All connection attempts failed", None)
                if url in servers.refuse:
                    raise Refused("400 bad key", 400)

            def delete_objects(
                self, keys: Sequence[EncodedKey], tier: TierName = "all", *, force: bool = False
            ) -> DeleteObjectsReply:
                self._check("delete", tier)
                if servers.deleting is not None:
                    own = servers.deleting(url, keys, tier)
                    if own is not None:
                        return own
                servers.deleted.append(list(keys))
                return DeleteObjectsReply(len(keys), 0, True)

            def submit_prefetch(
                self,
                model_name: str,
                world_size: int,
                token_ids: Sequence[int],
                cache_salt: str = "",
            ) -> PrefetchSubmitted:
                self._check("prefetch", "l2")
                return PrefetchSubmitted(2, "submitted", "rid-1")

            def prefetch_status(self, request_id: str) -> PrefetchStatusReply | None:
                self._check("status", "")
                return servers.statuses.get(request_id)

            def hold(
                self,
                hold_id: str,
                model_name: str,
                world_size: int,
                token_ids: Sequence[int],
                cache_salt: str,
                source_instance_id: str,
                ttl_s: float,
            ) -> HoldReply:
                self._check("hold", "")
                held = KEYS if servers.holds is None else servers.holds
                left = servers.unfinished.pop(0) if servers.unfinished else 0
                missing = [k for k in KEYS if k not in held] if not left else []
                return HoldReply(hold_id, list(held), missing, 0, left)

            def release(self, hold_id: str) -> ReleaseReply:
                self._check("release", "")
                return ReleaseReply(hold_id, 2)

            def close(self) -> None:
                pass

        return One()


def setup(**fleet: object) -> tuple[CommandLog, FakeFleet, FakeServers, Delivery]:
    log = CommandLog(jitter=lambda: 1.0)
    f = FakeFleet(**fleet)  # type: ignore[arg-type]
    servers = FakeServers(f)
    return log, f, servers, Delivery(lambda: log, f, servers)


def test_a_delete_goes_to_its_instance_and_completes_when_the_directory_shows_no_copy() -> None:
    log, fleet, servers, delivery = setup(urls={"a": "http://a"})
    fleet.held = {object_key(k): [Copy("a", "l1", "dram", False)] for k in KEYS}
    c = log.new("delete", ["a"], KEYS, tier="all")
    delivery.run_once()
    assert servers.calls == [("http://a", "delete", "all")]
    assert log.get(c.command_id).state == "sent"  # type: ignore[union-attr]
    delivery.run_once()
    assert log.get(c.command_id).state == "sent"  # type: ignore[union-attr]  # copies remain
    fleet.held = {}  # the node's delete events came in
    delivery.run_once()
    assert log.get(c.command_id).state == "completed"  # type: ignore[union-attr]


def test_an_unreachable_instance_backs_off_and_a_refusal_fails_the_command() -> None:
    log, fleet, servers, delivery = setup(urls={"a": "http://a", "b": "http://b"})
    servers.down.add("http://a")
    servers.refuse.add("http://b")
    fleet.held = {object_key(KEYS[0]): [Copy("a", "l2", "fs", False)]}
    down = log.new("delete", ["a"], KEYS[:1], tier="l2")
    refused = log.new("delete", ["b"], KEYS[:1], tier="l2")
    delivery.run_once()
    got = log.get(down.command_id)
    assert got is not None and (got.state, got.attempts) == ("pending", 1)
    assert "connection" in got.last_error
    delivery.run_once()  # not due yet: the backoff holds it
    assert [c for c in servers.calls if c[0] == "http://a"] == [("http://a", "delete", "l2")]
    failed = log.get(refused.command_id)
    assert failed is not None and failed.state == "failed" and "400" in failed.last_error
    delivery.instance_back("a")  # it registered again: due at once
    servers.down.clear()
    delivery.run_once()
    assert log.get(down.command_id).state == "sent"  # type: ignore[union-attr]


def test_a_shared_pool_is_reached_through_a_live_member_when_its_instance_is_down() -> None:
    log, fleet, servers, delivery = setup(
        urls={"b": "http://b"}, pools={"a": {"pool"}, "b": {"pool"}}
    )
    fleet.held = {object_key(k): [Copy("a", "l2", "pool", True)] for k in KEYS}
    c = log.new("delete", ["a"], KEYS, tier="all")  # a is down (not registered)
    delivery.run_once()
    assert servers.calls == [("http://b", "delete", "l2")]
    fleet.held = {}
    delivery.run_once()
    assert log.get(c.command_id).state == "completed"  # type: ignore[union-attr]


def test_a_private_l2_copy_waits_for_its_own_instance() -> None:
    log, fleet, servers, delivery = setup(
        urls={"b": "http://b"}, pools={"a": {"pool"}, "b": {"pool"}}
    )
    fleet.held = {object_key(KEYS[0]): [Copy("a", "l2", "fs", False)]}
    c = log.new("delete", ["a"], KEYS[:1], tier="l2")
    delivery.run_once()
    assert servers.calls == []  # nobody else can delete a's private L2
    got = log.get(c.command_id)
    assert got is not None and got.state == "pending" and "not registered" in got.last_error


def test_an_instance_down_with_only_l1_copies_has_nothing_left_to_delete() -> None:
    """Its L1 went with its process (fenced): the delete is done, nothing was sent."""
    log, _fleet, servers, delivery = setup()
    c = log.new("delete", ["a"], KEYS, tier="l1")
    delivery.run_once()
    assert servers.calls == [] and log.get(c.command_id).state == "completed"  # type: ignore[union-attr]


def test_an_instance_not_registered_since_a_restart_is_not_gone_until_its_timeout() -> None:
    """A coordinator restarted without a snapshot (or with one older than a registration)
    knows neither the instance nor its copies until the node registers and reports again.
    The old code took the unregistered target as gone and the empty directory as nothing
    left: the delete completed unsent, and the node's private L2 copies, reported again when
    it registered, stayed (the journal test saw it as a delete completed after a kill -9).
    Until every live instance has had ``--instance-timeout`` to register, it waits."""
    log, fleet, servers, delivery = setup(starting=True)
    c = log.new("delete", ["a"], KEYS, tier="all")
    delivery.run_once()
    got = log.get(c.command_id)
    assert servers.calls == [] and got is not None and got.state == "pending"
    assert "not registered" in got.last_error
    fleet.starting = False  # a whole timeout later, a is not back: gone, its L1 with it
    delivery.instance_back("a")  # (due at once, instead of after its backoff)
    delivery.run_once()
    assert servers.calls == [] and log.get(c.command_id).state == "completed"  # type: ignore[union-attr]


def test_the_coordinators_fleet_takes_an_instance_as_gone_after_its_timeout_only() -> None:
    from kvatlas.coordinator.cache_control.fleet import CoordinatorFleet
    from kvatlas.coordinator.instances import InstanceRegistry
    from kvatlas.directory import KeyDirectory

    now = [100.0]
    registry = InstanceRegistry(30.0, on_fence=lambda _i: None, clock=lambda: now[0])
    fleet = CoordinatorFleet(registry, KeyDirectory(16), seen=lambda: {"b": None})
    assert not fleet.gone("a") and not fleet.gone("b")  # just made: a may register yet
    now[0] += 45.0  # a restore and the kernels' warm-up took longer than the timeout
    registry.open()  # the service starts taking registrations (CoordinatorService.start)
    assert not fleet.gone("a")
    now[0] += 30.0
    assert fleet.gone("a") and not fleet.gone("b")  # b: registered with another replica


def test_a_private_l2_of_a_pools_backend_is_no_membership_of_the_pool() -> None:
    """A shared fs pool's commands (a gone member's deletes) go through its members only: an
    instance whose own fs L2 is private (``shared: false``) is none of them (it was listed,
    and would have deleted the keys from its private L2 while the pool's copies stayed)."""
    from kvatlas.coordinator.cache_control.fleet import CoordinatorFleet
    from kvatlas.coordinator.instances import InstanceRegistry
    from kvatlas.directory import KeyDirectory
    from tests.directory.helpers import Emitter

    directory = KeyDirectory(16)
    for name, shared in (("pool-a", True), ("pool-b", True), ("private", False)):
        directory.consume(Emitter(name).batch("config", tier="l2", backend="fs", shared=shared,
                                              capacity_bytes=1 << 20, capacity_revision=1))  # fmt: skip
    fleet = CoordinatorFleet(InstanceRegistry(30.0, on_fence=lambda _i: None), directory)
    assert fleet.pools_of("pool-a") == fleet.pools_of("pool-b") == {"fs"}
    assert fleet.pools_of("private") == set()


def test_deregistration_fails_the_commands_that_need_the_instance() -> None:
    log, _fleet, _servers, delivery = setup()
    c = log.new("prefetch", ["a"], KEYS, token_ids=tuple(range(32)))
    other = log.new("prefetch", ["b"], KEYS, token_ids=tuple(range(32)))
    delivery.instance_left("a")
    assert log.get(c.command_id).state == "failed"  # type: ignore[union-attr]
    assert log.get(other.command_id).state == "pending"  # type: ignore[union-attr]


def test_a_prefetch_completes_once_its_instance_says_so_and_the_l1_copies_are_in() -> None:
    log, fleet, servers, delivery = setup(urls={"a": "http://a"})
    c = log.new("prefetch", ["a"], KEYS, token_ids=tuple(range(32)))
    delivery.run_once()
    sent = log.get(c.command_id)
    assert sent is not None and (sent.state, sent.remote_ids) == ("sent", ("rid-1",))
    servers.statuses["rid-1"] = PrefetchStatusReply("rid-1", "pending")
    delivery.run_once()
    assert log.get(c.command_id).state == "sent"  # type: ignore[union-attr]
    servers.statuses["rid-1"] = PrefetchStatusReply("rid-1", "completed", 2, 2)
    delivery.run_once()  # found 2, but the directory shows no L1 copy yet
    got = log.get(c.command_id)
    assert got is not None and (got.state, got.found_keys) == ("sent", 2)
    servers.statuses.pop("rid-1")  # forgotten after the first completed poll, as LMCache does
    fleet.held = {object_key(k): [Copy("a", "l1", "dram", False)] for k in KEYS}
    delivery.run_once()
    done = log.get(c.command_id)
    assert done is not None and (done.state, done.found_keys) == ("completed", 2)


def test_a_prefetch_the_instance_forgot_is_submitted_again() -> None:
    log, _fleet, _servers, delivery = setup(urls={"a": "http://a"})
    c = log.new("prefetch", ["a"], KEYS, token_ids=tuple(range(32)))
    delivery.run_once()  # submitted; the instance restarts and forgets it
    delivery.run_once()
    got = log.get(c.command_id)
    assert got is not None and got.state == "pending" and "forgot" in got.last_error


def test_the_routes_attempt_and_the_loops_meet_once_and_the_routes_answer_stays_true() -> None:
    """A new command is due at once: when the loop's pass delivers it first, the route's own
    attempt sends nothing again (delivered meanwhile); when the loop's attempt failed, the
    route's is a real second attempt (so its 502 is true)."""
    log, _fleet, servers, delivery = setup(urls={"a": "http://a"})
    c = log.new("delete", ["a"], KEYS, tier="all")
    delivery.run_once()  # the loop got there first
    assert delivery.deliver(c) is None and len(servers.calls) == 1
    servers.down.add("http://a")
    d = log.new("delete", ["a"], KEYS, tier="all")
    delivery.run_once()
    failed = delivery.deliver(d)
    assert failed is not None and failed[1] is None and len(servers.calls) == 3
    assert log.get(d.command_id).attempts == 2  # type: ignore[union-attr]


def test_a_delete_without_force_never_sends_a_key_pinned_after_it_was_recorded() -> None:
    """Pins are checked at every delivery, not only when the delete is recorded: a key pinned
    while the delete waited (its node down, say) is not sent (the node may not have read its
    pins yet), and a delete left only with pinned keys completes instead of being re-sent
    forever; ``force`` still reaches a pinned key."""
    log, fleet, servers, delivery = setup(urls={"a": "http://a"})
    pinned = {object_key(KEYS[1])}
    delivery.pinned = lambda keys: pinned & set(keys)
    sent_keys: list[list[str]] = []
    servers.deleting = lambda _url, keys, _tier: sent_keys.append([k.chunk_hash_hex for k in keys])
    fleet.held = {object_key(k): [Copy("a", "l2", "fs", False)] for k in KEYS}
    some = log.new("delete", ["a"], KEYS, tier="l2")
    delivery.run_once()
    assert sent_keys == [[KEYS[0].chunk_hash_hex]]  # the pinned key stayed home
    fleet.held = {object_key(KEYS[1]): [Copy("a", "l2", "fs", False)]}  # the pinned copy stays
    delivery.run_once()
    assert log.get(some.command_id).state == "completed"  # type: ignore[union-attr]
    only_pinned = log.new("delete", ["a"], KEYS[1:], tier="l2")
    delivery.run_once()
    assert len(sent_keys) == 1  # nothing sent for it
    assert log.get(only_pinned.command_id).state == "completed"  # type: ignore[union-attr]
    forced = log.new("delete", ["a"], KEYS[1:], tier="l2", force=True)
    delivery.run_once()
    assert sent_keys[-1] == [KEYS[1].chunk_hash_hex]
    assert log.get(forced.command_id).state == "sent"  # type: ignore[union-attr]


# ------------------------------------------------------------------ moves (cache_control/moves.py)


def l1(*instances: str) -> list[Copy]:
    return [Copy(i, "l1", "dram", False) for i in instances]


def move_setup(**fields: object) -> tuple[CommandLog, FakeFleet, FakeServers, Delivery, str]:
    log, fleet, servers, delivery = setup(urls={"a": "http://a", "b": "http://b"})
    c = log.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)), **fields)
    return log, fleet, servers, delivery, c.command_id


def test_a_move_deletes_what_the_target_holds_once_the_directory_shows_it_then_releases() -> None:
    """The source's copies go only after the target confirmed its hold *and* the directory
    shows the target's copies; only the held keys go (a key the source lacked is missing);
    done once the source's L1 copies are gone, then the hold is released."""
    log, fleet, servers, delivery, move_id = move_setup()
    servers.holds = KEYS[:1]
    fleet.held = {object_key(k): l1("a") for k in KEYS}  # the target's events not in yet
    delivery.run_once()
    assert servers.calls == [("http://b", "hold", "")]  # nothing deleted
    c = log.get(move_id)
    assert c is not None and (c.state, c.phase, c.found_keys, c.missing) == (
        "pending",
        "holding",
        1,
        1,
    )
    assert "does not show" in c.last_error
    fleet.held[object_key(KEYS[0])] = l1("a", "b")
    delivery.instance_back("b")  # due now rather than after the backoff
    delivery.run_once()
    assert servers.calls[-2:] == [("http://b", "hold", ""), ("http://a", "delete", "l1")]
    assert servers.deleted == [KEYS[:1]]  # only what the target holds
    c = log.get(move_id)
    assert c is not None and (c.state, c.phase, c.deleted) == ("sent", "deleting", 1)
    delivery.run_once()  # the source's copy is still shown
    assert log.get(move_id).state == "sent"  # type: ignore[union-attr]
    fleet.held[object_key(KEYS[0])] = l1("b")
    delivery.run_once()
    c = log.get(move_id)
    assert c is not None and (c.state, c.phase) == ("completed", "done")
    assert servers.calls[-1] == ("http://b", "release", "")


def test_a_move_restored_from_a_snapshot_holds_again_before_it_deletes() -> None:
    """A coordinator killed mid-move: the restored command starts its attempt over from the
    hold, so a target that lost the keys meanwhile (it restarted) loses nothing more, the
    source keeps them."""
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a") for k in KEYS}
    delivery.run_once()  # held, the directory does not show it yet: the kill comes here
    assert log.get(move_id).phase == "holding"  # type: ignore[union-attr]
    restored = CommandLog.from_snapshot(log.to_snapshot(), jitter=lambda: 1.0)
    servers.calls.clear()
    servers.holds = []  # the target restarted and holds none of them now
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}  # a stale view of the target
    again = Delivery(lambda: restored, fleet, servers)
    again.instance_back("b")
    again.run_once()
    assert servers.calls[0] == ("http://b", "hold", "")
    assert servers.deleted == []  # nothing the target does not hold
    got = restored.get(move_id)
    assert got is not None and got.found_keys == 0 and got.missing == 2


def test_pinned_source_copies_are_skipped_and_keep_source_deletes_nothing() -> None:
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}
    delivery.pinned = lambda keys: {object_key(KEYS[1])} & set(keys)
    delivery.run_once()
    assert servers.deleted == [KEYS[:1]]
    c = log.get(move_id)
    assert c is not None and (c.skipped, c.deleted, c.moving) == (1, 1, (0,))
    copy = log.new("move", ["b"], KEYS, tier="l1", source="a", keep_source=True,
                   token_ids=tuple(range(32)))  # fmt: skip
    servers.deleted.clear()
    delivery.run_once()
    got = log.get(copy.command_id)
    assert got is not None and (got.state, got.found_keys) == ("completed", 2)
    assert servers.deleted == [] and servers.calls[-1] == ("http://b", "release", "")


def test_a_move_retries_an_unreachable_target_and_fails_on_a_refusal() -> None:
    log, _fleet, servers, delivery, move_id = move_setup()
    servers.down.add("http://b")
    delivery.run_once()
    c = log.get(move_id)
    assert c is not None and (c.state, c.phase, c.attempts) == ("pending", "loading", 1)
    servers.down.clear()
    servers.refuse.add("http://b")  # e.g. an LMCache server: no hold route
    delivery.instance_back("b")
    delivery.run_once()
    c = log.get(move_id)
    assert c is not None and c.state == "failed" and "400" in c.last_error


def test_a_source_leaving_fails_a_move_before_the_hold_but_not_after() -> None:
    log, fleet, _servers, delivery, early = move_setup()
    delivery.instance_left("a")
    assert log.get(early).state == "failed"  # type: ignore[union-attr]
    late = log.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
    fleet.held = {object_key(k): l1("a") for k in KEYS}
    delivery.run_once()  # held; the directory does not show the target's copies yet
    assert log.get(late.command_id).phase == "holding"  # type: ignore[union-attr]
    delivery.instance_left("a")
    del fleet.urls["a"]
    fleet.held = {object_key(k): l1("b") for k in KEYS}  # its L1 went with its process
    delivery.instance_back("b")
    delivery.run_once()
    got = log.get(late.command_id)
    assert got is not None and (got.state, got.deleted) == ("completed", 0)


def test_a_move_whose_target_loads_in_parts_deletes_nothing_until_it_is_all_loaded() -> None:
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}
    servers.holds, servers.unfinished = KEYS[:1], [1]
    delivery.run_once()  # one loaded, one to go: loading still, due at the next pass
    c = log.get(move_id)
    assert c is not None and (c.state, c.phase, c.found_keys, c.attempts) == (
        "pending",
        "loading",
        1,
        0,
    )
    assert servers.deleted == []
    servers.holds = None
    delivery.run_once()
    assert servers.deleted == [KEYS] and log.get(move_id).phase == "deleting"  # type: ignore[union-attr]


def test_a_failed_move_releases_its_partial_hold_on_the_target() -> None:
    """A move that fails after the target held some of its keys releases that hold (best
    effort, as a completed one does) rather than leaving them unevictable for the hold's
    10 minutes: the source deregistering while the target was still loading, and a refusal
    (4xx) of the source's delete. A target that left has nothing to release."""
    log, _fleet, servers, delivery, early = move_setup()
    servers.holds, servers.unfinished = KEYS[:1], [1]
    delivery.run_once()  # one key held, one to go
    assert log.get(early).phase == "loading"  # type: ignore[union-attr]
    delivery.instance_left("a")
    delivery.run_once()
    assert log.get(early).state == "failed"  # type: ignore[union-attr]
    assert servers.calls[-1] == ("http://b", "release", "")

    log, fleet, servers, delivery, refused = move_setup()
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}
    servers.refuse.add("http://a")  # the source refuses the delete
    delivery.run_once()
    assert log.get(refused).state == "failed"  # type: ignore[union-attr]
    assert servers.calls[-2:] == [("http://a", "delete", "l1"), ("http://b", "release", "")]

    log, _fleet, servers, delivery, gone = move_setup()
    servers.unfinished = [1]
    delivery.run_once()
    delivery.instance_left("b")
    del _fleet.urls["b"]
    servers.calls.clear()
    delivery.run_once()
    assert log.get(gone).state == "failed" and servers.calls == []  # type: ignore[union-attr]


def test_a_retried_delete_of_the_source_counts_each_removed_copy_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``deleted`` adds each attempt's replies, and an attempt after a partial delete sends
    every batch again; it does not over-count, because the source counts only the copies it
    removes (a node's L1 delete, as LMCache's: "What a real lmcache server answers"), so a
    batch sent again counts 0 for the copies already gone. Likewise a ``sent`` move whose
    events are late is delivered again and adds nothing."""
    monkeypatch.setattr(moves, "MAX_DELETE_KEYS", 1)  # one batch a key
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}
    source_l1 = {k.chunk_hash_hex for k in KEYS}
    fail_next = [False, True]  # the second batch of the first attempt does not get through

    def source(_url: str, keys: Sequence[EncodedKey], _tier: str) -> DeleteObjectsReply:
        if fail_next and fail_next.pop(0):
            raise Refused("All connection attempts failed", None)
        removed = source_l1 & {k.chunk_hash_hex for k in keys}
        source_l1.difference_update(removed)
        return DeleteObjectsReply(len(removed), 0, True)

    servers.deleting = source
    delivery.run_once()
    c = log.get(move_id)
    assert c is not None and (c.state, c.phase, c.deleted) == ("pending", "deleting", 1)
    delivery.instance_back("a")
    delivery.run_once()  # both batches again: the first removes nothing now
    c = log.get(move_id)
    assert c is not None and (c.state, c.deleted, source_l1) == ("sent", 2, set())
    log.confirm_s = -1.0  # its events are late: delivered again
    delivery.run_once()
    c = log.get(move_id)
    assert c is not None and (c.state, c.deleted) == ("sent", 2)


def test_the_source_deletes_count_adds_to_the_count_recorded_meanwhile() -> None:
    """Each batch's removals are added to the count as the log has it when they are recorded,
    not to the attempt's own earlier read: with the shared log, a replica whose lease ran out
    during a long attempt and the replica that took the move over both count what their
    deletes removed (the source counts each removal once), and neither overwrites the other."""
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}

    def source(_url: str, _keys: Sequence[EncodedKey], _tier: str) -> DeleteObjectsReply:
        log.progress(move_id, deleted=1)  # the other replica's delete removed one
        return DeleteObjectsReply(1, 0, True)  # and this one the other

    servers.deleting = source
    delivery.run_once()
    c = log.get(move_id)
    assert c is not None and (c.state, c.deleted) == ("sent", 2)


def test_a_slow_instance_does_not_hold_up_the_commands_to_another() -> None:
    """A pass delivers to each instance on its own worker: a delete to ``a``, whose server
    answers only once the delete to ``b`` (recorded after it) has been sent, does not keep
    that one waiting; the commands to one instance still go out in the order recorded."""
    log, fleet, servers, delivery = setup(urls={"a": "http://a", "b": "http://b"})
    fleet.held = {object_key(k): [Copy("a", "l2", "fs", False)] for k in KEYS}
    b_seen = threading.Event()
    waited: list[bool] = []
    sent: list[tuple[str, str]] = []

    def slow_a(url: str, _keys: Sequence[EncodedKey], tier: str) -> None:
        if url == "http://a" and not waited:
            waited.append(b_seen.wait(timeout=10))  # only a guard against a hang
        sent.append((url, tier))
        if url == "http://b":
            b_seen.set()

    servers.deleting = slow_a
    first = log.new("delete", ["a"], KEYS, tier="l1")
    log.new("delete", ["b"], KEYS, tier="l1")
    then = log.new("delete", ["a"], KEYS, tier="l2")
    assert first.created_at <= then.created_at
    delivery.run_once()
    assert waited == [True]  # b's delete went out while a's was still waiting
    assert [s for s in sent if s[0] == "http://a"] == [("http://a", "l1"), ("http://a", "l2")]
    assert {c.state for c in log.unfinished()} == {"sent"}


def test_two_commands_never_wait_for_each_others_delivery() -> None:
    """The route's attempt and the loop's meet on one command, which they take one at a time;
    two commands do not: the deliveries to ``a`` and ``b`` overlap whatever their ids (the old
    code took one of 64 striped locks by the id's hash: two ids on one stripe waited for each
    other, so a slow instance held up another's command; these two ids share a stripe)."""
    log, fleet, servers, delivery = setup(urls={"a": "http://a", "b": "http://b"})
    fleet.held = {object_key(k): [Copy("a", "l2", "fs", False)] for k in KEYS}
    ids = [uuid.uuid4().hex for _ in range(65)]
    slot = {i: hash(i) % 64 for i in ids}
    first = next(i for i in ids if any(slot[j] == slot[i] for j in ids if j != i))
    second = next(j for j in ids if j != first and slot[j] == slot[first])
    for command_id, target in ((first, "a"), (second, "b")):
        log.record(Command(command_id=command_id, kind="delete", targets=(target,),
                                  keys=tuple(KEYS), tier="l1"))  # fmt: skip
    b_seen = threading.Event()
    waited: list[bool] = []

    def slow_a(url: str, _keys: Sequence[EncodedKey], _tier: str) -> None:
        if url == "http://a":
            waited.append(b_seen.wait(timeout=10))  # only a guard against a hang
        else:
            b_seen.set()

    servers.deleting = slow_a
    delivery.run_once()
    assert waited == [True]
    assert {c.state for c in log.unfinished()} == {"sent"}


def test_a_move_failed_while_it_deletes_deletes_no_further_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The target deregisters (the move fails) while the source deletes the first batch: the
    attempt sends no further batch (the source keeps the copies the target took with it)."""
    monkeypatch.setattr(moves, "MAX_DELETE_KEYS", 1)  # one batch a key
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a", "b") for k in KEYS}

    def source(_url: str, _keys: Sequence[EncodedKey], _tier: str) -> None:
        delivery.instance_left("b")  # meanwhile the target leaves
        del fleet.urls["b"]

    servers.deleting = source
    delivery.run_once()
    assert servers.deleted == [KEYS[:1]]
    assert log.get(move_id).state == "failed"  # type: ignore[union-attr]


def test_a_move_whose_source_left_while_it_held_completes_without_holding_again() -> None:
    """The source leaves once the target holds every key (``holding``: not failed, its copies
    went with it): the next attempt completes the move rather than asking the target to hold
    again, which the target cannot (it would load from the gone source), retried forever."""
    log, fleet, servers, delivery, move_id = move_setup()
    fleet.held = {object_key(k): l1("a") for k in KEYS}
    delivery.run_once()  # held; the directory does not show the target's copies yet
    assert log.get(move_id).phase == "holding"  # type: ignore[union-attr]
    delivery.instance_left("a")
    del fleet.urls["a"]
    servers.down.add("http://b")  # a hold now fails: the source it loads from is gone
    servers.calls.clear()
    delivery.instance_back("b")
    delivery.run_once()
    got = log.get(move_id)
    assert got is not None and (got.state, got.phase) == ("completed", "done")
    assert ("http://b", "hold", "") not in servers.calls


def test_a_workers_copy_of_a_due_command_is_not_sent_once_its_attempt_was_pushed_out() -> None:
    """A pass reads the due commands, then a worker sends them one after the other; a command
    whose next attempt was pushed out meanwhile (the route's own attempt failed, or another
    replica's did) is not sent by the worker's older copy (negative control: the one before
    it is sent)."""
    log, _fleet, servers, delivery = setup(urls={"a": "http://a"})
    first = log.new("delete", ["a"], KEYS[:1], tier="all")
    second = log.new("delete", ["a"], KEYS[1:], tier="all")

    def meanwhile(_url: str, _keys: Sequence[EncodedKey], _tier: str) -> None:
        log.delivery_failed(second.command_id, "the route's attempt: down")

    servers.deleting = meanwhile
    delivery.run_once()
    assert servers.deleted == [KEYS[:1]]
    assert log.get(first.command_id).state == "sent"  # type: ignore[union-attr]
    got = log.get(second.command_id)
    assert got is not None and (got.state, got.attempts) == ("pending", 1)


# ------------------------------------------------------------------ moves across replicas


class ReplicaPair(NamedTuple):
    logs: list[SharedCommandLog]
    fleets: list[FakeFleet]
    servers: FakeServers
    deliveries: list[Delivery]


@pytest.fixture
def replica_pair(redis_server: RedisServer) -> Iterator[ReplicaPair]:
    """Two replicas over one shared log in a real Redis: ``a`` has the target ``b``
    registered, ``b`` the source ``a`` (nodes talk to one replica; each sees the other's in
    ``<stream>:instances``); one directory view."""
    stream = f"kvatlas:move-replicas-{uuid.uuid4().hex}"
    logs = [SharedCommandLog(SharedStore.connect(redis_server.url, stream, owner),
                             jitter=lambda: 1.0) for owner in ("A", "B")]  # fmt: skip
    held = {object_key(k): l1("a", "b") for k in KEYS}
    fleets = [FakeFleet(urls={"b": "http://b"}, elsewhere={"a"}, held=held),
              FakeFleet(urls={"a": "http://a"}, elsewhere={"b"}, held=held)]  # fmt: skip
    servers = FakeServers(fleets[0])  # one record of every call, by URL
    a, b = logs
    deliveries = [Delivery(lambda: a, fleets[0], servers), Delivery(lambda: b, fleets[1], servers)]
    try:
        yield ReplicaPair(logs, fleets, servers, deliveries)
    finally:
        for log in logs:
            log.store.client.close()


def test_a_move_across_replicas_deletes_through_the_sources_replica(
    replica_pair: ReplicaPair,
) -> None:
    """The target registered with replica A, the source with B: A's attempt holds and, the
    source not being its own (it has not left), lets the lease go; B deletes the source's
    copies from that recent hold and the move completes once the directory shows them gone;
    A, which reaches the target, finishes it and releases the hold. (The old code: A
    completed the move at once, deleting nothing.) A hold confirmed too long ago is not
    deleted from: B leaves the move to A for a new hold."""
    (log_a, log_b), (fleet_a, _), servers, (a, b) = replica_pair
    c = log_a.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
    a.run_once()
    got = log_a.get(c.command_id)
    assert got is not None and (got.state, got.phase, got.deleted) == (
        "pending",
        "deleting",
        0,
    )
    assert "not registered with this replica" in got.last_error
    assert servers.calls == [("http://b", "hold", "")] and servers.deleted == []
    b.instance_back("a")  # the source (re-)registers with B: due now
    b.run_once()
    assert servers.calls[-1] == ("http://a", "delete", "l1") and servers.deleted == [KEYS]
    assert log_b.get(c.command_id).state == "sent"  # type: ignore[union-attr]
    for k in KEYS:
        fleet_a.held[object_key(k)] = l1("b")  # the source's delete events
    b.run_once()  # B cannot reach the target to release its hold: it leaves the end to A
    assert log_b.get(c.command_id).state == "sent"  # type: ignore[union-attr]
    a.run_once()
    got = log_a.get(c.command_id)
    assert got is not None and (got.state, got.phase, got.deleted) == (
        "completed",
        "done",
        2,
    )
    assert servers.calls[-1] == ("http://b", "release", "")

    # a stale hold: B deletes nothing and lets it go; A holds again, then B deletes
    servers.calls.clear()
    servers.deleted.clear()
    for k in KEYS:
        fleet_a.held[object_key(k)] = l1("a", "b")
    c = log_a.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
    a.run_once()
    log_a.progress(c.command_id, held_at=log_a.now() - moves.HANDOVER_S - 1)
    b.instance_back("a")
    b.run_once()
    assert servers.deleted == []  # not B's to carry now: its target's replica holds again
    assert log_b.get(c.command_id).attempts == 1  # type: ignore[union-attr]
    servers.calls.clear()
    a.instance_back("b")
    a.run_once()
    assert servers.calls == [("http://b", "hold", "")] and servers.deleted == []
    b.instance_back("a")
    b.run_once()
    assert servers.deleted == [KEYS]


def test_a_handed_over_move_whose_target_was_fenced_deletes_nothing(
    replica_pair: ReplicaPair,
) -> None:
    """The target (A's) holds and hands the move over, then misses its heartbeats: A fences
    it. B's directory may still show the target's copies, so B must not delete the source's:
    the move fails at the fence, as it does when the target deregisters. (The old code: B
    deleted the source's copies from the hold, the keys then nowhere.)"""
    (log_a, _log_b), _fleets, servers, (a, b) = replica_pair
    c = log_a.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
    a.run_once()  # held; handed over to B
    a.instance_fenced("b")
    b.instance_back("a")
    b.run_once()
    got = log_a.get(c.command_id)
    assert servers.deleted == []
    assert got is not None and got.state == "failed" and "'b'" in got.last_error


def test_a_source_that_left_as_its_replica_saw_it_completes_the_move_on_another(
    replica_pair: ReplicaPair,
) -> None:
    """The source deregisters, or is fenced, at B once the target (A's) holds the keys: A,
    whose directory may still show the source's copies, completes the move without deleting
    (``source_left`` is in the shared record). A source that registers again before that
    is deleted from as usual."""
    (log_a, _log_b), _fleets, servers, (a, b) = replica_pair
    for leave in (b.instance_left, b.instance_fenced):
        c = log_a.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
        a.run_once()  # held; handed over to B
        leave("a")
        a.instance_back("b")
        a.run_once()
        got = log_a.get(c.command_id)
        assert got is not None and (got.state, got.phase, got.deleted) == (
            "completed",
            "done",
            0,
        )
    assert servers.deleted == []
    c = log_a.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
    a.run_once()
    b.instance_fenced("a")
    b.instance_back("a")  # it was alive: registered again, its copies reported again
    b.run_once()
    assert servers.deleted == [KEYS]


def test_a_replica_leaves_the_commands_of_another_replicas_instances_to_it(
    replica_pair: ReplicaPair,
) -> None:
    """``b`` is registered with replica A only (B sees it in ``<stream>:instances``): B, which
    cannot reach its MP server, takes no lease on its delete, neither in its pass nor in a
    route's first attempt, so A delivers it at its first pass (the old code: B's pass took the
    lease, failed, and pushed the next attempt out by the backoff, which A then waited out).
    Whether the command is done stays open to every replica: B completes the delete A holds
    once its directory shows the copies gone. A command for B's own instance ``a`` is B's
    (negative control)."""
    (log_a, log_b), (fleet_a, _), servers, (a, b) = replica_pair
    c = log_a.new("delete", ["b"], KEYS, tier="l1")
    assert b.deliver(c) is None  # a route's attempt on B: not B's to send
    b.run_once()  # B's pass first
    assert servers.calls == []
    got = log_b.get(c.command_id)
    assert got is not None and (got.state, got.attempts) == ("pending", 0)
    a.run_once()
    assert servers.calls == [("http://b", "delete", "l1")]
    assert log_a.get(c.command_id).state == "sent"  # type: ignore[union-attr]
    for k in KEYS:
        fleet_a.held[object_key(k)] = l1("a")  # b's delete events (both directories)
    b.run_once()  # A holds the lease; B finishes it from its directory
    assert log_a.get(c.command_id).state == "completed"  # type: ignore[union-attr]

    own = log_a.new("delete", ["a"], KEYS, tier="l1")
    a.run_once()
    b.run_once()
    assert servers.calls[-1] == ("http://a", "delete", "l1")
    assert log_b.get(own.command_id).state == "sent"  # type: ignore[union-attr]


def test_the_sources_replica_takes_no_lease_on_a_move_only_the_targets_replica_can_start(
    replica_pair: ReplicaPair,
) -> None:
    """Until the target holds the keys, a move is its target's replica's (A) to carry: the
    source's replica (B), whose pass runs first, takes no lease, so A's first pass holds at
    once (the old code: B took the lease, failed with "target 'b' is not registered" and
    pushed the next attempt out by its backoff). Once handed over (``deleting``), the move is
    B's: A leaves it alone."""
    (log_a, log_b), _fleets, servers, (a, b) = replica_pair
    c = log_a.new("move", ["b"], KEYS, tier="l1", source="a", token_ids=tuple(range(32)))
    b.run_once()
    got = log_b.get(c.command_id)
    assert got is not None and (got.state, got.phase, got.attempts) == ("pending", "queued", 0)
    a.run_once()
    assert servers.calls == [("http://b", "hold", "")]
    got = log_a.get(c.command_id)
    assert got is not None and got.phase == "deleting" and got.attempts == 1
    assert not a.carries(got) and b.carries(got)
