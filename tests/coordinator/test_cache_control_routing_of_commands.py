"""Where the delivery loop sends a command and when it finishes it
(``kvatlas/coordinator/cache_control/delivery.py``), with the fleet and the MP servers as
fakes: every case runs in milliseconds. Real processes: ``test_cache_control_delivery.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvatlas.api.cache_control import (
    DeleteObjectsReply,
    EncodedKey,
    PrefetchStatusReply,
    PrefetchSubmitted,
    TierName,
)
from kvatlas.coordinator.cache_control import CommandLog
from kvatlas.coordinator.cache_control.delivery import Copy, Delivery, MpServer, object_key
from kvatlas.errors import Unavailable
from kvatlas.keys import ObjectKey, pack_kv_rank

KEYS = [EncodedKey(f"{n:064x}", "m", pack_kv_rank(1, 0, 1, 0)) for n in (1, 2)]


class Refused(Unavailable):
    def __init__(self, message: str, reply_status: int | None) -> None:
        super().__init__(message)
        self.reply_status = reply_status


@dataclass
class FakeFleet:
    urls: dict[str, str] = field(default_factory=dict)  # registered instances
    pools: dict[str, set[str]] = field(default_factory=dict)  # instance -> shared backends
    held: dict[ObjectKey, list[Copy]] = field(default_factory=dict)

    def url_of(self, instance_id: str) -> str | None:
        return self.urls.get(instance_id)

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
    inner = servers.__call__

    def recording(url: str) -> MpServer:
        one = inner(url)
        delete = one.delete_objects

        def delete_objects(keys: Sequence[EncodedKey], tier: TierName = "all", *,
                           force: bool = False) -> DeleteObjectsReply:  # fmt: skip
            sent_keys.append([k.chunk_hash_hex for k in keys])
            return delete(keys, tier, force=force)

        one.delete_objects = delete_objects  # type: ignore[method-assign]
        return one

    delivery.servers = recording
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
