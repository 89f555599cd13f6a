"""Oracle property test: KeyDirectory + gate == a naive model applying the same events.

Random interleavings of store/delete/access/fence/deregister plus duplicated, reordered,
stale and gapped batches, optionally a snapshot/restore round trip in the middle. Keys of two
cache salts share chunk hashes: each salt's binding is its own (directory/tenant_bindings.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory, KeyFilter, load_snapshot, save_snapshot
from kvatlas.directory.salt_usage import bytes_by_salt
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank

CS = 4
HASHES = [bytes([n]) * 32 for n in range(1, 6)]
SHAPES = [("m", 1, 0, ""), ("m", 1, 0, "t2"), ("m", 2, 0, ""), ("m", 2, 1, ""), ("x", 1, 0, "")]
KEYS = [
    ObjectKey(h, model, pack_kv_rank(ws, rank, ws, rank), 0, salt)
    for h in HASHES
    for model, ws, rank, salt in SHAPES
]
CONTENTS = [
    np.array(c, dtype=np.uint32) for c in ([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 5], [9, 9, 9])
]
for c in CONTENTS:
    c.flags.writeable = False
PLACES = [("l1", "dram", False), ("l2", "fs", False), ("l2", "pool", True)]
INSTANCES = ["a", "b"]


@dataclass
class Model:
    """The spec, applied naively: dict of dicts, tuples of ints, no indexes."""

    cursors: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    placements: dict[ObjectKey, dict[tuple[Any, ...], tuple[Any, ...]]] = field(
        default_factory=dict
    )
    bindings: dict[tuple[bytes, str], tuple[tuple[int, ...], int]] = field(default_factory=dict)
    """(chunk hash, cache salt) -> (ids, offset): each salt's own binding of a chunk."""

    def consume(self, b: EventBatch) -> str:
        cur = self.cursors.get(b.instance_id)
        if cur is not None and b.incarnation < cur[0]:
            return "stale"
        if cur is not None and b.incarnation == cur[0] and b.seq <= cur[1]:
            return "duplicate"
        gaps, missing = (0, 0) if cur is None else cur[2:]
        if cur is not None and b.incarnation > cur[0]:
            self.fence(b.instance_id)
        last = 0 if cur is None or b.incarnation > cur[0] else cur[1]
        if b.seq > last + 1:
            gaps, missing = gaps + 1, missing + b.seq - last - 1
        self.cursors[b.instance_id] = (b.incarnation, b.seq, gaps, missing)
        ident = (b.tier, b.backend, None if b.shared else b.instance_id)
        for e in b.entries:
            pls = self.placements.setdefault(e.key, {})
            if b.event_type == "store":
                pls[ident] = (
                    b.instance_id,
                    b.incarnation,
                    b.tier,
                    b.backend,
                    e.size_bytes,
                    b.shared,
                )
                if e.token_ids is not None:
                    tokens = tuple(e.token_ids.tolist())
                    at = (e.key.chunk_hash, e.key.cache_salt)
                    old = self.bindings.get(at)
                    ns = BlendNamespace.from_object_key(e.key)
                    others = any(  # another namespace of the salt: its binding stays
                        k.chunk_hash == e.key.chunk_hash
                        and k.cache_salt == e.key.cache_salt
                        and BlendNamespace.from_object_key(k) != ns
                        for k in self.placements
                    )
                    conflict = old and old[0] != tokens and others
                    no_news = old and old[0] == tokens and e.token_offset == -1
                    if not (conflict or no_news):
                        self.bindings[at] = (tokens, e.token_offset)
            elif b.event_type == "delete":
                pls.pop(ident, None)
            self._cleanup(e.key)
        return "applied"

    def fence(self, inst: str) -> None:
        for k in list(self.placements):
            pls = self.placements[k]
            for ident in [i for i in pls if i[0] == "l1" and i[2] == inst]:
                del pls[ident]
            self._cleanup(k)

    def deregister(self, inst: str) -> None:
        self.fence(inst)
        self.cursors.pop(inst, None)

    def _cleanup(self, k: ObjectKey) -> None:
        if not self.placements.get(k):
            self.placements.pop(k, None)
            if not any(
                o.chunk_hash == k.chunk_hash and o.cache_salt == k.cache_salt
                for o in self.placements
            ):
                self.bindings.pop((k.chunk_hash, k.cache_salt), None)

    def expected_matches(self, content: np.ndarray[Any, Any], ns: BlendNamespace) -> set[Any]:
        want = tuple(content.tolist())
        out = set()
        for (h, salt), (tokens, offset) in self.bindings.items():
            if salt != ns.cache_salt or tokens != want or offset == -1 or len(tokens) != CS:
                continue
            if any(
                k.chunk_hash == h and BlendNamespace.from_object_key(k) == ns
                for k in self.placements
            ):
                out.add((h, offset))
        return out


def check(d: KeyDirectory, m: Model) -> None:
    for kp in d.lookup(KEYS):
        got = {
            (p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes, p.shared)
            for p in kp.placements
        }
        assert got == set(m.placements.get(kp.key, {}).values()), kp.key
    stats = d.stats()
    assert stats.keys == len(m.placements)
    assert stats.placements == sum(len(p) for p in m.placements.values())
    cursors = d.emitters()
    assert {
        i: (c.incarnation, c.last_seq, c.gaps, c.missing_batches) for i, c in cursors.items()
    } == m.cursors
    listed = {kp.key for kp in d.list_keys(limit=10_000).items}
    assert listed == set(m.placements)
    for kp in d.lookup(KEYS):  # the bound content comes with a stored key, none without
        at = (kp.key.chunk_hash, kp.key.cache_salt)
        bound = m.bindings.get(at) if kp.key in m.placements else None
        assert (None if kp.content is None else tuple(kp.content.tolist())) == (
            None if bound is None else bound[0]
        ), kp.key
    check_usage(d, m)


def check_usage(d: KeyDirectory, m: Model) -> None:
    """Placements and bytes per module, per tier, and filtered key counts, against the model."""
    want: dict[tuple[Any, ...], tuple[int, int]] = {}
    for pls in m.placements.values():
        for (tier, backend, owner), row in pls.items():
            n, used = want.get((owner, tier, backend), (0, 0))
            want[(owner, tier, backend)] = (n + 1, used + row[4])
    got = {
        (u.instance_id, u.tier, u.backend): (u.placements, u.used_bytes) for u in d.usage().modules
    }
    assert got == want
    by_tier = d.stats().placements_by_tier
    assert by_tier == {t: sum(n for (_, tt, _), (n, _) in want.items() if tt == t) for t in by_tier}
    for tier, backend, _ in PLACES:
        held = {k for k, pls in m.placements.items() if any(i[:2] == (tier, backend) for i in pls)}
        assert d.count_keys(KeyFilter(tier=tier, backend=backend)) == len(held)
    assert d.count_keys() == len(m.placements)
    # L2 bytes per salt (quota usage), kept as placements come and go, against the model and
    # against one pass over the records
    l2_by_salt: dict[str, int] = {}
    for k, pls in m.placements.items():
        for (tier, _backend, _owner), row in pls.items():
            if tier == "l2":
                l2_by_salt[k.cache_salt] = l2_by_salt.get(k.cache_salt, 0) + row[4]
    want_salts = {s: n for s, n in l2_by_salt.items() if n}
    assert d.bytes_by_salt("l2") == want_salts
    assert bytes_by_salt(d._chunks, d._lock, "l2") == want_salts
    spaces = {BlendNamespace.from_object_key(k) for k in KEYS}
    for content in CONTENTS[:3]:
        for ns in spaces:
            got = {(x.chunk_hash, x.old_st) for x in d.blend_match(content, ns)}
            assert got == m.expected_matches(content, ns), (content, ns)


@st.composite
def entry_st(draw: st.DrawFn) -> CacheEntry:
    tokens = draw(st.none() | st.sampled_from(CONTENTS))
    offset = draw(st.sampled_from([-1, 0, 4, 8]))
    return CacheEntry(draw(st.sampled_from(KEYS)), draw(st.integers(0, 3)), tokens, offset)


OPS = [
    "store",
    "store",
    "store",
    "delete",
    "delete",
    "access",
    "fence",
    "deregister",
    "restart",
    "duplicate",
    "stale",
    "gap",
    "reorder",
    "snapshot",
]


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_directory_equals_naive_model(data: st.DataObject, tmp_path: Path) -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    m = Model()
    state = {i: [1, 0] for i in INSTANCES}  # incarnation, last seq sent
    sent: list[EventBatch] = []
    held: list[EventBatch] = []

    def make(inst: str, kind: str, skip: int = 0, incarnation: int | None = None) -> EventBatch:
        inc, seq = state[inst]
        if incarnation is None:
            seq = seq + 1 + skip
            state[inst][1] = seq
        tier, backend, shared = data.draw(st.sampled_from(PLACES))
        es = tuple(data.draw(st.lists(entry_st(), max_size=5))) if kind != "config" else ()
        return EventBatch(
            inst,
            inc if incarnation is None else incarnation,
            seq if incarnation is None else 1,
            kind,
            tier,
            backend,
            shared,
            float(seq),
            es,
        )

    def apply(b: EventBatch) -> None:
        assert d.consume(b).value == m.consume(b)
        sent.append(b)

    for _ in range(data.draw(st.integers(5, 30))):
        op = data.draw(st.sampled_from(OPS))
        inst = data.draw(st.sampled_from(INSTANCES))
        if op in ("store", "delete", "access"):
            apply(make(inst, op))
        elif op == "fence":
            d.fence_instance(inst)
            m.fence(inst)
        elif op == "deregister":
            d.deregister(inst)
            m.deregister(inst)
        elif op == "restart":
            state[inst] = [state[inst][0] + 1, 0]
            apply(make(inst, "store"))
        elif op == "duplicate" and sent:
            apply(data.draw(st.sampled_from(sent)))
        elif op == "stale" and state[inst][0] > 1:
            apply(make(inst, "delete", incarnation=state[inst][0] - 1))
        elif op == "gap":
            apply(make(inst, "store", skip=data.draw(st.integers(1, 3))))
        elif op == "reorder":
            held.append(make(inst, data.draw(st.sampled_from(["store", "delete"]))))
            if len(held) > 1 or data.draw(st.booleans()):
                for b in reversed(held):
                    apply(b)
                held.clear()
        elif op == "snapshot":
            path = tmp_path / "dir.snap"
            save_snapshot(d, path, stream_position=str(len(sent)))
            d = KeyDirectory(CS, enable_blend_lookup=True)
            assert load_snapshot(d, path).stream_position == str(len(sent))
        check(d, m)
    check(d, m)
