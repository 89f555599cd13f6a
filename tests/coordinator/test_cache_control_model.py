"""The coordinator's cache-control model below HTTP (``kvatlas.coordinator.cache_control``):
LMCache 0.5.7rc2's golden cache-control exchanges replayed against the functions the routes
will call (same status, same reply), pins with reference counts, quotas with LMCache's
semantics, and durable commands that survive a restart (snapshot) and back off while an
instance is down."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import pytest

from kvatlas.api import decode, encode
from kvatlas.api.cache_control import (
    CoordinatorDeleteBody,
    CoordinatorPrefetchBody,
    EncodedKey,
    QuotaConfig,
    QuotaSetBody,
    QuotaSetReply,
    TokenFields,
)
from kvatlas.coordinator.cache_control import (
    CacheControl,
    Command,
    CommandLog,
    PinTable,
    QuotaTable,
    Retry,
)
from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.errors import KvatlasError
from kvatlas.keys import ObjectKey

GOLDEN = Path(__file__).with_name("data") / "lmcache-0.5.7rc2-cache-control.json"
FORWARDED = 502  # LMCache's answer when the MP server it forwards to is unreachable


def replay(
    control: CacheControl, instances: set[str], e: dict[str, Any]
) -> tuple[int, Any, Command | None]:
    """One exchange through the service: (status, reply JSON, the command it recorded)."""
    method, url = e["method"], urlsplit(e["path"])
    path, query = (
        url.path,
        {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()},
    )
    raw = json.dumps(e["body"]).encode() if e["body"] is not None else b""
    try:
        if (method, path) == ("POST", "/instances"):
            instances.add(e["body"]["instance_id"])
            return 200, e["lmcache_response"], None  # registration: test_lmcache_conformance.py
        if path == "/cache/pins" and method in ("POST", "DELETE"):
            fields = decode(raw, TokenFields)
            reply: Any = control.pin(fields) if method == "POST" else control.unpin(fields)
        elif (method, path) == ("GET", "/cache/pins"):
            reply = control.list_pins(
                query.get("cache_salt"), query.get("model_name"),
                int(query.get("offset", 0)), int(query.get("limit", 1000)),
            )  # fmt: skip
        elif (method, path) == ("POST", "/cache/delete"):
            outcome = control.delete(decode(raw, CoordinatorDeleteBody))
            return (
                (FORWARDED if outcome.command else 200),
                json.loads(encode(outcome.reply)),
                outcome.command,
            )
        elif (method, path) == ("POST", "/cache/prefetches"):
            done = control.prefetch(decode(raw, CoordinatorPrefetchBody))
            return (
                (FORWARDED if done.command else 202),
                json.loads(encode(done.reply)),
                done.command,
            )
        elif method == "GET" and path.startswith("/cache/prefetches/"):
            _, _, _, instance_id, request_id = path.split("/")
            status = control.prefetch_status(instance_id, request_id)
            if status is None:  # not a command of ours: the route asks the instance
                return FORWARDED, None, None
            reply = status
        elif path == "/quota/config":
            reply = (
                control.set_quota_config(decode(raw, QuotaConfig))
                if method == "PUT"
                else control.quota_config()
            )
        elif path == "/quota":
            reply = control.quotas_listed()
        elif path.startswith("/quota/"):
            salt = path.split("/", 2)[2]
            if method == "PUT":
                reply = control.set_quota(salt, decode(raw, QuotaSetBody))
            elif method == "DELETE":
                reply = control.remove_quota(salt)
            else:
                reply = control.quota(salt)
        else:
            raise AssertionError(f"no function for {method} {path}")
    except KvatlasError as exc:
        return exc.status, {"detail": exc.detail}, None
    return 200, json.loads(encode(reply)), None


def test_golden_exchanges_replay_through_the_service() -> None:
    golden = json.loads(GOLDEN.read_text())
    instances: set[str] = set()
    control = CacheControl(
        golden["chunk_size"], is_instance=instances.__contains__, usage_by_salt=dict
    )
    problems = []
    for i, e in enumerate(golden["exchanges"]):
        status, got, command = replay(control, instances, e)
        want = e["lmcache_response"]
        where = f"#{i} {e['method']} {e['path']} ({e['note']})"
        if status != e["lmcache_status"]:
            problems.append(f"{where}: status {status}, LMCache {e['lmcache_status']}: {got}")
        elif status == 200 and got != want:
            problems.append(f"{where}: {got} != LMCache's {want}")
        if status == FORWARDED and e["path"] == "/cache/delete":
            body = e["body"]
            assert command is not None and command.targets == (body["instance_id"],)
            assert (command.tier, command.force) == (
                body.get("tier", "all"),
                body.get("force", False),
            )
    assert problems == []


def fields(tokens: int, salt: str = "", world_size: int = 1) -> TokenFields:
    return TokenFields(
        model_name="m", world_size=world_size, token_ids=list(range(tokens)), cache_salt=salt
    )


def test_pins_count_per_key_and_unpin_floors_at_zero() -> None:
    control = CacheControl(16, is_instance=lambda _i: True, usage_by_salt=dict)
    assert control.pin(fields(40)).affected == 2  # two complete chunks, the rest ignored
    control.pin(fields(40))
    keys = control.resolve(fields(40)).keys
    assert [control.pins.count(k) for k in keys] == [2, 2]
    for _ in range(3):
        control.unpin(fields(40))
    assert [control.pins.count(k) for k in keys] == [0, 0] and control.list_pins(
        None, None, 0, 10
    ).total == 0
    assert control.pin(fields(16, world_size=4)).affected == 4  # one key per rank


def test_delete_skips_pinned_keys_unless_forced_and_sends_the_rest() -> None:
    control = CacheControl(16, is_instance={"a"}.__contains__, usage_by_salt=dict)
    control.pin(fields(16))
    body = dict(model_name="m", world_size=1, token_ids=list(range(48)), instance_id="a", tier="l2")
    out = control.delete(CoordinatorDeleteBody(**body))  # type: ignore[arg-type]
    assert (out.reply.requested, out.reply.affected, out.reply.skipped) == (3, 2, 1)
    assert out.command is not None and len(out.command.keys) == 2
    pinned = control.resolve(fields(16)).keys[0]
    assert ObjectKey.from_wire(msgspec.to_builtins(out.command.keys[0])) != pinned
    forced = control.delete(CoordinatorDeleteBody(**body, force=True))  # type: ignore[arg-type]
    assert (forced.reply.affected, forced.reply.skipped) == (3, 0) and forced.command is not None
    assert control.pins.count(pinned) == 1  # a forced delete leaves the pin (LMCache's golden)
    with pytest.raises(KvatlasError) as refused:
        control.delete(CoordinatorDeleteBody(**{**body, "instance_id": "b"}))  # type: ignore[arg-type]
    assert refused.value.status == 404


def test_token_cap_and_bad_fields_are_400_and_record_nothing() -> None:
    control = CacheControl(16, is_instance=lambda _i: True, usage_by_salt=dict)
    for bad in (
        fields(1_000_001),
        fields(3, salt="a/b"),
        TokenFields(model_name="m", world_size=1, token_ids=[-1] * 16),
    ):
        with pytest.raises(KvatlasError) as refused:
            control.pin(bad)
        assert refused.value.status == 400
    assert control.pins.rows() == [] and control.commands.counts() == {}


def test_quota_semantics_null_exempt_zero_evicts_default_names_the_empty_salt() -> None:
    quotas = QuotaTable()
    assert quotas.effective_gb("t") is None and not quotas.over_limit("t", 10 * int(GB))  # exempt
    quotas.set_default(0.0)
    assert quotas.over_limit("t", 1) and not quotas.over_limit("t", 0)  # 0: anything is too much
    quotas.set("t", 1.0)
    assert not quotas.over_limit("t", int(0.5 * GB), watermark=0.8)
    assert quotas.over_limit("t", int(0.8 * GB) + 1, watermark=0.8)
    control = CacheControl(
        16, is_instance=lambda _i: True, usage_by_salt=lambda: {"": int(GB // 2)}, quotas=quotas
    )
    assert control.set_quota("_default", QuotaSetBody(limit_gb=2.0)).cache_salt == ""
    assert control.quota("_default") == msgspec.convert(
        {"cache_salt": "", "quota_limit_gb": 2.0, "quota_exists": True, "usage_gb": 0.5},
        type(control.quota("_default")),
    )
    assert control.remove_quota("t").status == "removed"
    assert control.remove_quota("t") == QuotaSetReply("t", 0.0, "not_found")  # LMCache's 200
    with pytest.raises(KvatlasError) as bad:
        control.set_quota("a@b", QuotaSetBody(limit_gb=1.0))
    assert bad.value.status == 400


def key(n: int) -> EncodedKey:
    return EncodedKey(f"{n:064x}", "m", 1 << 24 | 1 << 8)


def test_a_command_backs_off_while_its_instance_is_down_then_completes() -> None:
    now = [1000.0]
    log = CommandLog(retry=Retry(1.0, 8.0), clock=lambda: now[0], jitter=lambda: 1.0)
    c = log.new("delete", ["a"], [key(1)], tier="l2")
    assert [d.command_id for d in log.due()] == [c.command_id]
    waits = []
    for _ in range(5):
        c = log.delivery_failed(c.command_id, "connection refused")
        waits.append(c.next_attempt_at - now[0])
        assert log.due() == []
        now[0] = c.next_attempt_at
        assert [d.command_id for d in log.due()] == [c.command_id]
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0] and c.attempts == 5  # doubling, capped
    c = log.delivered(c.command_id)
    assert c.state == "sent" and log.due() == []
    now[0] += log.confirm_s + 1  # no events came: delivered again
    assert [d.command_id for d in log.due()] == [c.command_id]
    c = log.finish(c.command_id, "completed")
    assert log.due() == [] and log.counts() == {("delete", "completed"): 1}
    now[0] += log.retention_s + 1
    assert log.prune() == 1 and log.get(c.command_id) is None


def test_commands_survive_a_restart_through_the_snapshot() -> None:
    """A coordinator killed mid-command: its snapshot holds the command, and the restarted one
    delivers it again (a sent command whose events never came, at once)."""
    log = CommandLog()
    pending = log.new("delete", ["a"], [key(1), key(2)], tier="all", force=True)
    sent = log.delivered(log.new("prefetch", ["b"], [key(3)], tier="l2").command_id, ("rid-1",))
    done = log.finish(log.new("evict", ["c"], [key(4)]).command_id, "completed")
    restored = CommandLog.from_snapshot(log.to_snapshot())
    assert restored.get(pending.command_id) == pending
    again = restored.get(sent.command_id)
    assert again is not None and again.state == "pending" and again.remote_ids == ("rid-1",)
    assert restored.get(done.command_id) == done
    assert {c.command_id for c in restored.due()} == {pending.command_id, sent.command_id}
    with pytest.raises(msgspec.DecodeError):
        CommandLog.from_snapshot(b"\x00garbage")


def test_pin_table_rows_round_trip_in_order() -> None:
    control = CacheControl(16, is_instance=lambda _i: True, usage_by_salt=dict)
    control.pin(fields(48, salt="x"))
    control.pin(fields(48))
    again = PinTable(control.pins.rows())
    assert again.rows() == control.pins.rows() and len(again.rows()) == 6


def test_pin_listing_filters_by_salt_and_default_names_the_empty_one() -> None:
    control = CacheControl(16, is_instance=lambda _i: True, usage_by_salt=dict)
    control.pin(fields(32, salt="x"))
    control.pin(fields(16))
    assert control.list_pins("", None, 0, 10).total == 3  # empty: every salt (LMCache)
    assert control.list_pins("x", None, 0, 10).total == 2
    only_empty = control.list_pins("_default", None, 0, 10)
    assert only_empty.total == 1 and only_empty.pins[0].key.cache_salt == ""
    assert [p.key for p in control.list_pins(None, None, 1, 1).pins] == [
        control.list_pins("x", None, 1, 1).pins[0].key
    ]
    for limit in (0, 10_001):
        with pytest.raises(KvatlasError) as bad:
            control.list_pins(None, None, 0, limit)
        assert bad.value.status == 422


def test_pins_quotas_and_commands_survive_a_restart_in_the_snapshot_file(tmp_path: Path) -> None:
    """Written with the directory's snapshot (its ``cache_control`` section) and read back by
    a fresh coordinator: every pin with its count, the quotas, the unfinished commands."""
    from kvatlas.coordinator.cache_control import SECTION, encode_state, restore_state
    from kvatlas.directory import KeyDirectory
    from kvatlas.directory.snapshot import load_snapshot, save_snapshot

    before = CacheControl(16, is_instance={"a"}.__contains__, usage_by_salt=dict)
    before.pin(fields(48))
    before.pin(fields(16))
    before.pin(fields(32, salt="t"))
    before.quotas.set_default(None)
    before.quotas.set("t", 2.5)
    before.quotas.set("", 0.0)
    body = dict(model_name="m", world_size=1, token_ids=list(range(64)), instance_id="a")
    deleting = before.delete(CoordinatorDeleteBody(**body)).command  # type: ignore[arg-type]
    assert deleting is not None
    path = tmp_path / "snap"
    save_snapshot(KeyDirectory(16), path, sections={SECTION: encode_state(before)})

    info = load_snapshot(KeyDirectory(16), path)
    assert info.sections is not None
    after = CacheControl(16, is_instance={"a"}.__contains__, usage_by_salt=dict)
    restore_state(after, info.sections[SECTION])
    assert after.pins.rows() == before.pins.rows()
    assert [n for _k, n in after.pins.rows()][:1] == [2]  # the first chunk was pinned twice
    assert (after.quotas.default_limit_gb, after.quotas.limits()) == (None, {"t": 2.5, "": 0.0})
    assert after.commands.get(deleting.command_id) == deleting
    assert [c.command_id for c in after.commands.due()] == [deleting.command_id]

    save_snapshot(KeyDirectory(16), path)  # a snapshot without the section: nothing to restore
    assert load_snapshot(KeyDirectory(16), path).sections is None
    with pytest.raises(KvatlasError) as corrupt:
        restore_state(after, b"\x93garbage")
    assert corrupt.value.status == 400 and after.pins.rows() == before.pins.rows()  # unchanged


def test_prefetch_status_comes_from_the_command_until_it_completes() -> None:
    control = CacheControl(16, is_instance={"a", "b"}.__contains__, usage_by_salt=dict)
    body = dict(model_name="m", world_size=1, token_ids=list(range(48)), instance_id="a")
    out = control.prefetch(CoordinatorPrefetchBody(**body))  # type: ignore[arg-type]
    assert out.command is not None and out.reply.request_id == out.command.command_id
    rid = out.reply.request_id
    assert json.loads(encode(control.prefetch_status("a", rid))) == {"status": "pending"}
    control.commands.finish(rid, "completed", found_keys=2)
    done = json.loads(encode(control.prefetch_status("a", rid)))
    assert done == {"status": "completed", "found_keys": 2, "total_keys": 3}
    assert control.prefetch_status("b", rid) is None  # another instance's: asked of it
    assert control.prefetch_status("a", "theirs") is None
    with pytest.raises(KvatlasError) as unknown:
        control.prefetch_status("nobody", rid)
    assert unknown.value.status == 404


def test_moves_are_validated_before_anything_is_recorded() -> None:
    from kvatlas.api.cache_control import MoveBody

    control = CacheControl(16, is_instance={"a", "b"}.__contains__, usage_by_salt=dict)
    base = dict(model_name="m", world_size=1, token_ids=list(range(32)))
    for raw, status in (
        ({**base, "source_instance_id": "a", "target_instance_id": "a"}, 400),
        ({**base, "source_instance_id": "a", "target_instance_id": "nobody"}, 404),
        ({**base, "source_instance_id": "a", "target_instance_id": "b", "keep_sorce": True}, 422),
        ({**base, "source_instance_id": "a"}, 422),
    ):
        with pytest.raises(KvatlasError) as refused:
            control.move(decode(json.dumps(raw).encode(), MoveBody))
        assert refused.value.status == status, raw
    assert control.commands.counts() == {}
    reply, command = control.move(MoveBody(**base, source_instance_id="a", target_instance_id="b"))  # type: ignore[arg-type]
    assert (reply.requested, reply.status) == (2, "pending") and command is not None
    # a move deletes the source's copies (keep_source false), never forced past a pin
    assert (command.kind, command.source, command.targets) == ("move", "a", ("b",))
    assert (command.keep_source, command.force, command.phase) == (False, False, "queued")


def test_a_moves_status_is_kept_for_the_retention_then_404() -> None:
    """A finished move's status stays readable ``retention_s`` (an hour by default, the
    retention of every finished command), then the id is unknown (404)."""
    from kvatlas.api.cache_control import MoveBody
    from kvatlas.coordinator.cache_control import CommandLog

    now = [1000.0]
    log = CommandLog(clock=lambda: now[0])
    control = CacheControl(
        16, is_instance={"a", "b"}.__contains__, usage_by_salt=dict, commands=log
    )
    base = dict(model_name="m", world_size=1, token_ids=list(range(32)))
    _reply, command = control.move(MoveBody(**base, source_instance_id="a", target_instance_id="b"))  # type: ignore[arg-type]
    assert command is not None
    log.progress(command.command_id, phase="done", missing=1, deleted=1)
    log.finish(command.command_id, "completed", found_keys=1)
    now[0] += log.retention_s - 1
    assert log.prune() == 0
    status = control.move_status(command.command_id)
    assert (status.status, status.phase, status.requested) == ("completed", "done", 2)
    assert (status.loaded, status.missing, status.deleted, status.skipped) == (1, 1, 1, 0)
    now[0] += 2
    assert log.prune() == 1
    with pytest.raises(KvatlasError) as gone:
        control.move_status(command.command_id)
    assert gone.value.status == 404


def test_the_coordinator_goldens_quota_and_pin_exchanges_replay_through_the_service() -> None:
    """The controller exchanges of ``lmcache-0.5.7rc2-coordinator.json`` below HTTP: quota
    config, a salt's quota, its status, the listing, its removal, the (empty) pin listing.
    Usage comes from events that scenario posted before; here the directory's bytes per salt
    are given as LMCache counted them (the directory does not count them yet)."""
    from tests.coordinator.lmcache_goldens import DATA, shape_problems

    golden = json.loads((DATA / "lmcache-0.5.7rc2-coordinator.json").read_text())
    wanted = [e for e in golden["exchanges"] if e["path"].startswith(("/quota", "/cache/pins"))]
    assert len(wanted) == 7
    usage = {"": round(3.814697265625e-06 * GB)}  # what the scenario's store events held
    control = CacheControl(
        golden["chunk_size"], is_instance=lambda _i: True, usage_by_salt=lambda: usage
    )
    for e in wanted:
        status, got, _command = replay(control, set(), e)
        assert status == e["lmcache_status"], (e["path"], got)
        assert got == e["lmcache_response"], (e["method"], e["path"], got)
        assert shape_problems(e["lmcache_response"], got) == []


def test_a_snapshot_taken_while_the_shared_store_is_away_keeps_the_restored_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the Redis transport cache control is read from Redis at each snapshot; Redis away
    at the first snapshot after a restart must not write a snapshot without the section the
    restart read (pins and quotas would be gone should Redis then come back empty)."""
    from kvatlas.coordinator import snapshots
    from kvatlas.coordinator.cache_control import SECTION
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.service import CoordinatorService
    from kvatlas.directory import KeyDirectory
    from kvatlas.directory.snapshot import load_snapshot
    from kvatlas.errors import Unavailable

    config = CoordinatorConfig(chunk_size=16, snapshot_path=str(tmp_path / "snap"))
    first = CoordinatorService(config)
    first.cache_control.pin(fields(48))
    assert first.take_snapshot() is not None

    def away(*_state: object) -> bytes:
        raise Unavailable("redis away")

    restarted = CoordinatorService(config)
    assert restarted.snapshots.restore() is not None
    monkeypatch.setattr(snapshots, "encode_state", away)
    assert restarted.take_snapshot() is not None
    sections = load_snapshot(KeyDirectory(16), config.snapshot_path).sections
    assert sections is not None and SECTION in sections
