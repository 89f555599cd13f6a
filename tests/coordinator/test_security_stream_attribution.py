"""Issue 25 item 7: a producer that can ``XADD`` to the event stream (the documented ``+xadd``
Redis user) cannot write entries the coordinator attributes to another node. Each attack runs
against a real coordinator process reading a real redis-server with auth on; the attacker
holds the Redis emit credential and one node's own token (a compromised node A).

Entries are signed per node (docs/security.md, "Redis transport"): the MAC is recomputed here
from the documented construction, independently of ``kvatlas.events.stream_format``, so a bug
in the signing code cannot hide behind a matching verifier. And an incarnation can never jump
past what a node can reach (a start time in ns, at most ``--max-clock-skew-s`` ahead of the
coordinator's clock), on the stream and over HTTP alike.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import blake3
import httpx
import pytest
import redis

from kvatlas.coordinator.server import free_port
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.stream_format import encode_stream_fields
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.conftest import RedisServer, wait_for
from tests.coordinator.helpers import fresh, post_batches, wire_batch, wire_entry, wire_key
from tests.coordinator.security_support import ADMIN, bearer, spawn_coordinator, token, write_tokens

TOP = (1 << 63) - 1  # the incarnation that locked a node out until it was deregistered
VICTIMS = ("victim-1", "victim-2", "victim-3", "victim-4")
VICTIM_SALT, ATTACKER_SALT = "tenant-v", "tenant-a"
ATTACKER = token("node-a")  # node A's own token: emit + lookup, node-a, tenant-a


def victim_token(name: str) -> str:
    return token(name)


# ---------------------------------------------------------------- the documented MAC, rebuilt


def _derive(tok: str, context: str) -> bytes:
    return blake3.blake3(tok.encode(), derive_key_context=context).digest()


def signed(fields: dict[bytes, bytes], stream: str, tok: str) -> dict[bytes, bytes]:
    """``fields`` signed as docs/security.md says: key id and MAC key derived from the node's
    coordinator token, the MAC a keyed BLAKE3 over the stream name, key id, format and data."""
    key_id = _derive(tok, "kvatlas stream entry key id v1")[:8].hex().encode()
    mac = blake3.blake3(key=_derive(tok, "kvatlas stream entry MAC key v1"))
    for part in (b"kvatlas-stream-entry-v1", stream.encode(), key_id, fields[b"fmt"]):
        mac.update(len(part).to_bytes(4, "big") + part)
    mac.update(fields[b"data"])
    return {**fields, b"kid": key_id, b"mac": mac.hexdigest().encode()}


# ---------------------------------------------------------------- the fleet under attack


def _key(tag: int, salt: str) -> ObjectKey:
    return ObjectKey(bytes([tag]) * 32, "m", pack_kv_rank(1, 0, 1, 0), 0, salt)


def _batch(inst: str, inc: int, seq: int, kind: str, *keys: ObjectKey, **kw: Any) -> EventBatch:
    entries = tuple(CacheEntry(k, 10) for k in keys)
    return EventBatch(inst, inc, seq, kind, "l1", "dram", entries=entries, **kw)


def _wire(inst: str, inc: int, seq: int, kind: str, *tags: int, salt: str) -> dict[str, Any]:
    entries = [wire_entry(wire_key(bytes([t]) * 32, salt=salt)) for t in tags]
    return wire_batch(inst, inc, seq, kind, entries=entries)


class Fleet:
    def __init__(self, url: str, stream: str, rclient: redis.Redis) -> None:
        self.http = httpx.Client(base_url=url, timeout=30.0)
        self.stream = stream
        self.redis = rclient

    def xadd(self, fields: dict[bytes, bytes]) -> str:
        """Append like the ``+xadd`` user; returns once the coordinator consumed the entry."""
        entry_id = self.redis.xadd(self.stream, fields)  # type: ignore[arg-type]
        position = entry_id.decode()
        assert wait_for(lambda: self.health()["stream_position"] == position), self.health()
        return position

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get("/healthz").json()
        return body

    def placements(self, instance_id: str) -> set[tuple[str, str, int]]:
        """``(chunk hash hex[:2], salt, incarnation)`` of every placement of ``instance_id``."""
        r = self.http.get(
            "/directory/keys", params={"instance_id": instance_id}, headers=bearer(ADMIN)
        )
        assert r.status_code == 200, r.text
        return {
            (k["key"]["chunk_hash_hex"][:2], k["key"]["cache_salt"], p["incarnation"])
            for k in r.json()["keys"]
            for p in k["placements"]
            if p["instance_id"] == instance_id
        }

    def incarnation(self, instance_id: str) -> int | None:
        rows = self.http.get("/instances", headers=bearer(ADMIN)).json()["instances"]
        row = next(r for r in rows if r["instance_id"] == instance_id)
        inc: int | None = row.get("incarnation")
        return inc

    def rejected(self) -> dict[str, float]:
        text = self.http.get("/metrics", headers=bearer(ADMIN)).text
        pattern = r'kvatlas_stream_rejected_entries_total\{reason="([a-z_]+)"\} ([0-9.e+]+)'
        return {reason: float(v) for reason, v in re.findall(pattern, text)}

    def refused(self) -> dict[str, float]:
        """``kvatlas_event_refused_entries_total{reason="cache_salt"}`` by transport."""
        text = self.http.get("/metrics", headers=bearer(ADMIN)).text
        pattern = (
            r'kvatlas_event_refused_entries_total\{reason="cache_salt",transport="([a-z]+)"\} (\S+)'
        )
        return {transport: float(v) for transport, v in re.findall(pattern, text)}

    def emit(self, tok: str, *batches: dict[str, Any]) -> httpx.Response:
        return post_batches(self.http, *batches, headers=bearer(tok))


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    stream = fresh("attribution")
    node_tokens = [
        {
            "token": victim_token(v),
            "roles": ["emit", "lookup"],
            "instance_ids": [v],
            "cache_salts": [VICTIM_SALT],
        }
        for v in VICTIMS
    ]
    tokens = write_tokens(
        tmp_path_factory.mktemp("attribution") / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {
            "token": ATTACKER,
            "roles": ["emit", "lookup"],
            "instance_ids": ["node-a"],
            "cache_salts": [ATTACKER_SALT],
        },
        *node_tokens,
    )
    port = free_port()
    proc = spawn_coordinator(
        port,
        "--event-transport", "redis", "--redis-url", redis_server.url, "--event-stream", stream,
        "--auth-token-file", str(tokens), "--instance-timeout", "600",
    )  # fmt: skip
    rclient = redis.Redis.from_url(redis_server.url)
    f = Fleet(f"http://127.0.0.1:{port}", stream, rclient)
    assert wait_for(lambda: f.http.get("/readyz").status_code == 200)
    for name, tok in [("node-a", ATTACKER), *((v, victim_token(v)) for v in VICTIMS)]:
        r = f.http.post("/instances", json={"instance_id": name}, headers=bearer(tok))
        assert r.status_code == 200, r.text
    try:
        yield f
    finally:
        f.http.close()
        rclient.close()
        proc.terminate()
        proc.wait(timeout=30)


def _victim_stores(f: Fleet, victim: str) -> int:
    """The victim stores chunk 0x11 under its salt (over HTTP, with its own token)."""
    inc = time.time_ns()
    r = f.emit(victim_token(victim), _wire(victim, inc, 1, "store", 0x11, salt=VICTIM_SALT))
    assert r.status_code == 200, r.text
    assert f.placements(victim) == {("11", VICTIM_SALT, inc)}
    return inc


def test_unsigned_entry_cannot_store_or_delete_for_a_node(fleet: Fleet) -> None:
    """A store under the victim's salt and a delete of its placement, in entries naming the
    victim without any signature: refused (``unsigned``), the victim's view unchanged."""
    inc = _victim_stores(fleet, "victim-1")
    before = fleet.rejected().get("unsigned", 0.0)
    forged_store = _batch("victim-1", inc, 2, "store", _key(0x66, VICTIM_SALT))
    fleet.xadd(encode_stream_fields([forged_store]))
    forged_delete = _batch("victim-1", inc, 3, "delete", _key(0x11, VICTIM_SALT))
    fleet.xadd(encode_stream_fields([forged_delete]))
    assert fleet.placements("victim-1") == {("11", VICTIM_SALT, inc)}
    assert fleet.rejected().get("unsigned", 0.0) == before + 2
    # the victim's own next batch is still in sequence: nothing of the forgery was applied
    r = fleet.emit(
        victim_token("victim-1"), _wire("victim-1", inc, 2, "store", 0x12, salt=VICTIM_SALT)
    )
    assert r.json()["applied"] == 1, r.text


def test_node_a_signature_cannot_speak_for_node_v(fleet: Fleet) -> None:
    """Node A signs with its own key an entry naming the victim (a delete of its placement):
    the signature is valid, the instance is not A's → refused (``forbidden``)."""
    inc = _victim_stores(fleet, "victim-2")
    before = fleet.rejected().get("forbidden", 0.0)
    delete = _batch("victim-2", inc, 2, "delete", _key(0x11, VICTIM_SALT))
    fleet.xadd(signed(encode_stream_fields([delete]), fleet.stream, ATTACKER))
    assert fleet.placements("victim-2") == {("11", VICTIM_SALT, inc)}
    assert fleet.rejected().get("forbidden", 0.0) == before + 1


def test_node_a_cannot_store_under_a_foreign_salt(fleet: Fleet) -> None:
    """Node A's signed entry for itself, with a key of the victim's tenant: that key is left
    out (counted in ``kvatlas_event_refused_entries_total{transport="stream"}``), like
    ``POST /events`` answers 403 naming the salt and the node's sink sends the rest again;
    A's own salt in the same entry is applied, under the batch's seq (no gap). It was refused
    whole: A's own keys were lost too, and the gap set off a digest exchange whose listing
    was refused whole again."""
    before = fleet.rejected()
    refused = fleet.refused().get("stream", 0.0)
    inc = time.time_ns()
    store = _batch("node-a", inc, 1, "store", _key(0x21, ATTACKER_SALT), _key(0x22, VICTIM_SALT))
    fleet.xadd(signed(encode_stream_fields([store]), fleet.stream, ATTACKER))
    assert fleet.placements("node-a") == {("21", ATTACKER_SALT, inc)}
    assert fleet.refused().get("stream", 0.0) == refused + 1
    assert fleet.rejected() == before  # the entry was applied, without the victim's key
    nothing = _batch("node-a", inc, 2, "delete", _key(0x11, VICTIM_SALT))  # left empty
    fleet.xadd(signed(encode_stream_fields([nothing]), fleet.stream, ATTACKER))
    own = _batch("node-a", inc, 3, "store", _key(0x23, ATTACKER_SALT))
    fleet.xadd(signed(encode_stream_fields([own]), fleet.stream, ATTACKER))
    assert fleet.placements("node-a") == {("21", ATTACKER_SALT, inc), ("23", ATTACKER_SALT, inc)}
    assert fleet.refused().get("stream", 0.0) == refused + 2
    row = next(
        r for r in fleet.http.get("/instances", headers=bearer(ADMIN)).json()["instances"]
        if r["instance_id"] == "node-a"
    )  # fmt: skip
    assert row["last_seq"] == 3 and row["gaps"] == 0, row


def test_forged_incarnation_cannot_lock_a_node_out(fleet: Fleet) -> None:
    """An entry naming the victim with incarnation 2^63-1 used to fence it for good (every
    later batch of the real node stale until deregistration): refused, the victim goes on."""
    inc = _victim_stores(fleet, "victim-3")
    fleet.xadd(encode_stream_fields([_batch("victim-3", TOP, 1, "store", _key(0x13, VICTIM_SALT))]))
    fleet.xadd(
        signed(
            encode_stream_fields([_batch("victim-3", TOP, 1, "delete", _key(0x11, VICTIM_SALT))]),
            fleet.stream,
            ATTACKER,
        )
    )
    assert fleet.incarnation("victim-3") == inc
    r = fleet.emit(
        victim_token("victim-3"), _wire("victim-3", inc, 2, "store", 0x12, salt=VICTIM_SALT)
    )
    assert r.json()["applied"] == 1, r.text
    assert fleet.placements("victim-3") == {("11", VICTIM_SALT, inc), ("12", VICTIM_SALT, inc)}


def test_a_node_cannot_jump_its_own_incarnation_past_its_clock(fleet: Fleet) -> None:
    """Even a node's own credential cannot set an incarnation no restart of it can reach
    (beyond the coordinator's clock + ``--max-clock-skew-s``): refused on the stream
    (``incarnation_ahead``) and over HTTP (422 naming the field), the cursor unchanged; a real
    restart (a new start time) still fences the old incarnation."""
    inc = _victim_stores(fleet, "victim-4")
    tok = victim_token("victim-4")
    before = fleet.rejected().get("incarnation_ahead", 0.0)
    ahead = _batch("victim-4", TOP, 1, "config", capacity_bytes=1, capacity_revision=1)
    fleet.xadd(signed(encode_stream_fields([ahead]), fleet.stream, tok))
    assert fleet.rejected().get("incarnation_ahead", 0.0) == before + 1
    r = fleet.emit(tok, _wire("victim-4", TOP, 1, "store", 0x14, salt=VICTIM_SALT))
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "batches[0].incarnation", r.text
    hour_ahead = time.time_ns() + 3600 * 10**9
    r = fleet.emit(tok, _wire("victim-4", hour_ahead, 1, "store", 0x14, salt=VICTIM_SALT))
    assert r.status_code == 422, r.text
    assert fleet.incarnation("victim-4") == inc
    assert fleet.placements("victim-4") == {("11", VICTIM_SALT, inc)}
    restart = time.time_ns()  # negative control: a real restart fences the old L1 copies
    r = fleet.emit(tok, _wire("victim-4", restart, 1, "store", 0x15, salt=VICTIM_SALT))
    assert r.json()["applied"] == 1, r.text
    assert fleet.placements("victim-4") == {("15", VICTIM_SALT, restart)}


def test_tampered_or_moved_entries_are_refused(fleet: Fleet) -> None:
    """A signed entry whose data was changed, or that was signed for another stream, or whose
    key id is unknown: refused (``bad_signature``)."""
    before = fleet.rejected().get("bad_signature", 0.0)
    inc = time.time_ns()
    good = signed(
        encode_stream_fields([_batch("node-a", inc, 1, "store", _key(0x31, ATTACKER_SALT))]),
        fleet.stream,
        ATTACKER,
    )
    other = encode_stream_fields([_batch("node-a", inc, 1, "store", _key(0x32, ATTACKER_SALT))])
    fleet.xadd({**good, b"data": other[b"data"]})
    fleet.xadd(signed(other, fleet.stream + "-elsewhere", ATTACKER))
    fleet.xadd(signed(other, fleet.stream, token("not-in-the-token-file")))
    assert fleet.rejected().get("bad_signature", 0.0) == before + 3
    assert not {p[0] for p in fleet.placements("node-a")} & {"31", "32"}  # none of these
