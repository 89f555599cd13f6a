"""Per-salt bindings (directory/tenant_bindings.py) against a naive model: a seeded
differential test.

Random store / delete / access / resync / fence / deregister / restart / snapshot round trip /
capture-with-interleaved-changes over 3 salts, 2 models, 2 world sizes (ranks), 2 object
groups, a few chunk hashes and contents, blend on; batches mixing salts and shapes, applied
entry by entry (``consume``) or as decoded JSON column bodies (``apply_columns``: the bulk,
columnar and store-run paths). After every step:

(a) the invariant: ``tenants.rows`` has an entry for h iff h's record has keys of >= 2 salts;
    such a record carries no binding; an entry binds only salts with keys;
(b) every key's lookup and listing content equals a naive per-(hash, salt) model;
(c) ``blend_match`` of every content in every namespace equals the naive expectation, and the
    index's claim/occupant counts equal the expected claims (no orphan claims).

A quarter of the seeds run with blend off until the first snapshot step (whose restore, blend
on, must index every binding: ``adopt_tenants``). ``REVIEW_SEEDS`` (env) sets how many seeds
run (default 40), ``REVIEW_SEED0`` the first, ``REVIEW_STEPS`` the steps of each.

Below it, reproductions of the defects the review found, each failing before its fix.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.capture import Capture, CapturedPart
from kvatlas.directory.records import record_indexed, record_keys, record_stored_tokens
from kvatlas.events import CacheEntry, EventBatch, decode_json_columns, encode_json
from kvatlas.events.model import VOLATILE_TIERS
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank

CS = 4
SALTS = ["", "s", "t"]
MODELS = ["m", "x"]
RANKS = [(1, 0), (2, 0), (2, 1)]
GROUPS = [0, 0, 0, 1]
HASHES = [bytes([n]) * 32 for n in (1, 2, 3, 5, 8, 13, 0x81, 0x90)] + [bytes([2]) + bytes(31)]
HOME = {h: SALTS[i % len(SALTS)] for i, h in enumerate(HASHES)}
KEYS = [
    ObjectKey(h, model, pack_kv_rank(ws, r, ws, r), g, salt)
    for h in HASHES
    for model in MODELS
    for ws, r in RANKS
    for g in sorted(set(GROUPS))
    for salt in SALTS
]
CONTENTS = [
    np.array(c, dtype=np.uint32)
    for c in ([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 5], [9, 9, 9], [70000, 70001, 70002, 70003])
]
for _c in CONTENTS:
    _c.flags.writeable = False
PROBES = [c for c in CONTENTS if len(c) == CS]
OFFSETS = [-1, 0, 4, 8]
PLACES = [("l1", "dram", False), ("l2", "fs", False), ("l2", "pool", True), ("l1", "cpu", False)]
INSTANCES = ["a", "b"]
NAMESPACES = sorted({BlendNamespace.from_object_key(k) for k in KEYS}, key=repr)


@dataclass
class Model:
    """The spec, naively: placements per key; each (chunk hash, salt)'s binding."""

    placements: dict[ObjectKey, dict[tuple[Any, ...], tuple[Any, ...]]] = field(
        default_factory=dict
    )
    bindings: dict[tuple[bytes, str], tuple[tuple[int, ...], int]] = field(default_factory=dict)
    cursors: dict[str, int] = field(default_factory=dict)  # incarnation

    def consume(self, b: EventBatch) -> None:
        cur = self.cursors.get(b.instance_id)
        if cur is not None and b.incarnation > cur:
            self.fence(b.instance_id)
        self.cursors[b.instance_id] = b.incarnation
        if b.event_type == "resync":
            self._drop_unlisted(b)
        ident = (b.tier, b.backend, None if b.shared else b.instance_id)
        for e in b.entries:
            pls = self.placements.setdefault(e.key, {})
            if b.event_type in ("store", "resync"):
                pls[ident] = (b.instance_id, b.incarnation, b.tier, b.backend, e.size_bytes,
                              b.shared)  # fmt: skip
                if e.token_ids is not None:
                    self._bind(e)
            elif b.event_type == "delete":
                pls.pop(ident, None)
            self._cleanup(e.key)

    def _bind(self, e: CacheEntry) -> None:
        assert e.token_ids is not None
        tokens = tuple(e.token_ids.tolist())
        at = (e.key.chunk_hash, e.key.cache_salt)
        old = self.bindings.get(at)
        ns = BlendNamespace.from_object_key(e.key)
        others = any(
            k.chunk_hash == e.key.chunk_hash
            and k.cache_salt == e.key.cache_salt
            and BlendNamespace.from_object_key(k) != ns
            for k in self.placements
        )
        conflict = old and old[0] != tokens and others
        no_news = old and old[0] == tokens and e.token_offset == -1
        if not (conflict or no_news):
            self.bindings[at] = (tokens, e.token_offset)

    def _drop_unlisted(self, b: EventBatch) -> None:
        listed = {e.key for e in b.entries}
        prefixes = set(b.prefixes or ())
        for k in list(self.placements):
            if k.chunk_hash[:1].hex() not in prefixes and k.chunk_hash[:2].hex() not in prefixes:
                continue
            pls = self.placements[k]
            for ident, row in list(pls.items()):
                if row[0] != b.instance_id or row[2] != b.tier or row[5]:
                    continue
                if row[3] != b.backend or k not in listed:
                    del pls[ident]
            self._cleanup(k)

    def fence(self, inst: str) -> None:
        for k in list(self.placements):
            pls = self.placements[k]
            for ident in [i for i in pls if i[0] in VOLATILE_TIERS and i[2] == inst]:
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

    def content(self, k: ObjectKey) -> tuple[int, ...] | None:
        if k not in self.placements:
            return None
        b = self.bindings.get((k.chunk_hash, k.cache_salt))
        return None if b is None else b[0]

    def claims(self) -> set[tuple[tuple[int, ...], bytes, int, BlendNamespace, str | None]]:
        """(ids, hash, offset, namespace, occupant salt) of every claim the index must hold:
        a chunk of several salts holds each salt's binding under an occupant of its own
        (``None``: a chunk of one salt's, under its hash)."""
        out = set()
        for (h, salt), (tokens, offset) in self.bindings.items():
            if offset == -1 or len(tokens) != CS:
                continue
            salts = {k.cache_salt for k in self.placements if k.chunk_hash == h}
            for k in self.placements:
                if k.chunk_hash == h and k.cache_salt == salt:
                    occupant = salt if len(salts) > 1 else None
                    out.add((tokens, h, offset, BlendNamespace.from_object_key(k), occupant))
        return out


def invariant(d: KeyDirectory) -> None:
    chunks = d._chunks
    rows = chunks.tenants.rows
    shapes = chunks.shapes.shapes
    held = set()
    for part in chunks.parts:
        for h, rec in part.items():
            held.add(h)
            salts = {shapes[sid].cache_salt for sid, _ in record_keys(rec)}
            if len(salts) > 1:
                assert h in rows, ("several salts, no tenants entry", h.hex(), salts)
                assert record_stored_tokens(rec) is None, ("several salts, bound record", h.hex())
                assert not record_indexed(rec)
                assert set(rows[h]) <= salts, ("binding of a salt without keys", h.hex())
            else:
                assert h not in rows, ("one salt, tenants entry", h.hex(), salts)
    assert set(rows) <= held, "tenants entry of a deleted chunk"


def check(d: KeyDirectory, m: Model, where: str = "") -> None:
    """(a), (b) and, with blend on, (c)."""
    invariant(d)
    for kp in d.lookup(KEYS):
        got = {
            (p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes, p.shared)
            for p in kp.placements
        }
        assert got == set(m.placements.get(kp.key, {}).values()), (where, kp.key)
        content = None if kp.content is None else tuple(kp.content.tolist())
        assert content == m.content(kp.key), (where, "lookup", kp.key)
    listed = d.list_keys(limit=100_000).items
    assert {kp.key for kp in listed} == set(m.placements), where
    for kp in listed:
        content = None if kp.content is None else tuple(kp.content.tolist())
        assert content == m.content(kp.key), (where, "listing", kp.key)
    stats = d.stats()
    assert stats.keys == len(m.placements), where
    assert stats.chunks == len({k.chunk_hash for k in m.placements}), where
    assert stats.bound_chunks == len(
        {h for h, s in m.bindings if any(k.chunk_hash == h for k in m.placements)}
    ), (where, "bound_chunks")
    if d.blend_index is None:
        return
    claims = m.claims()
    for probe in PROBES:
        want_ids = tuple(probe.tolist())
        for ns in NAMESPACES:
            matched = {(x.chunk_hash, x.old_st) for x in d.blend_match(probe, ns)}
            want = {(h, o) for t, h, o, n, _ in claims if t == want_ids and n == ns}
            assert matched == want, (where, "blend", want_ids, ns)
    bs = d.blend_index.stats()  # type: ignore[union-attr]
    assert bs.claims == len({(t, h, n, s) for t, h, _, n, s in claims}), (where, "index claims")
    assert bs.occupants == len({(t, h, s) for t, h, _, _, s in claims}), (where, "occupants")


class Run:
    def __init__(self, seed: int, tmp: Path, blend: bool = True) -> None:
        self.rng = random.Random(seed)
        self.tmp = tmp
        self.d = KeyDirectory(CS, enable_blend_lookup=blend)
        self.m = Model()
        self.state = {i: [1, 0] for i in INSTANCES}  # incarnation, last seq
        self.log: list[str] = []

    # ---------------------------------------------------------------- builders

    def key(self, salts: list[str] | None = None, h: bytes | None = None) -> ObjectKey:
        """Mostly one salt per chunk (its home) and the usual shape; sometimes another."""
        r = self.rng
        h = h if h is not None else r.choice(HASHES)
        ws, rank = RANKS[0] if r.random() < 0.6 else r.choice(RANKS)
        if salts is None:
            salt = HOME[h] if r.random() < 0.75 else r.choice(SALTS)
        else:
            salt = r.choice(salts)
        model = MODELS[0] if r.random() < 0.75 else r.choice(MODELS)
        group = 0 if r.random() < 0.85 else r.choice(GROUPS)
        return ObjectKey(h, model, pack_kv_rank(ws, rank, ws, rank), group, salt)

    def unheld(self, n: int) -> list[bytes]:
        held = {k.chunk_hash for k in self.m.placements}
        free = [h for h in HASHES if h not in held]
        return self.rng.sample(free, min(n, len(free))) or [self.rng.choice(HASHES)]

    def entry(self, k: ObjectKey, tokens: bool | None = None) -> CacheEntry:
        r = self.rng
        ids = (
            r.choice([None, *CONTENTS, CONTENTS[0], CONTENTS[1]])
            if tokens is None
            else (r.choice(PROBES) if tokens else None)
        )
        return CacheEntry(k, r.randint(0, 3), ids, r.choice(OFFSETS))

    def entries(self, kind: str) -> list[CacheEntry]:
        r = self.rng
        mode = r.choice(["mixed", "one-salt", "one-shape", "fresh"])
        n = r.randint(1, 5)
        if mode == "mixed":
            return [self.entry(self.key()) for _ in range(n)]
        if mode == "one-salt":
            salt = r.choice(SALTS)
            return [self.entry(self.key([salt])) for _ in range(n)]
        k0 = self.key()
        if mode == "fresh" or r.random() < 0.5:
            hashes = self.unheld(r.randint(1, 4))
        else:
            hashes = r.sample(HASHES, r.randint(1, len(HASHES)))
        keys = [ObjectKey(h, k0.model_name, k0.kv_rank, k0.object_group_id, k0.cache_salt)
                for h in hashes]  # fmt: skip
        if mode == "one-shape":
            return [self.entry(k) for k in keys]
        return [CacheEntry(k, r.randint(0, 3), r.choice(PROBES), r.choice(OFFSETS[1:]))
                for k in keys]  # fmt: skip

    def batch(self, inst: str, kind: str, place: tuple[str, str, bool] | None = None,
              entries: list[CacheEntry] | None = None) -> EventBatch:  # fmt: skip
        inc, seq = self.state[inst]
        seq += 1
        self.state[inst][1] = seq
        tier, backend, shared = place or self.rng.choice(PLACES)
        es = self.entries(kind) if entries is None else entries
        if entries is None and place is None and self.m.placements and self.rng.random() < 0.6:
            # existing keys, on a place they are held at (re-stores, deletes, accesses that
            # hit: the by-columns paths)
            k = self.rng.choice(sorted(self.m.placements, key=repr))
            ident = self.rng.choice(sorted(self.m.placements[k], key=repr))
            tier, backend, shared = ident[0], ident[1], ident[2] is None
            same = [o for o, pls in self.m.placements.items() if ident in pls]
            picked = self.rng.sample(same, min(len(same), self.rng.randint(1, 5)))
            es = []
            for o in sorted(picked, key=repr):
                bound = self.m.content(o)
                ids = None
                if bound is not None and self.rng.random() < 0.5:
                    ids = np.array(bound, np.uint32)
                elif self.rng.random() < 0.2:
                    ids = self.rng.choice(CONTENTS)
                es.append(CacheEntry(o, self.rng.randint(0, 3), ids, self.rng.choice(OFFSETS)))
        extra: dict[str, Any] = {}
        if kind == "resync":
            shared = False
            prefixes = {e.key.chunk_hash[:1].hex() for e in es}
            prefixes |= {h[:1].hex() for h in self.rng.sample(HASHES, 2)}
            extra["prefixes"] = tuple(sorted(prefixes))
        return EventBatch(inst, inc, seq, kind, tier, backend, shared, float(seq), tuple(es),
                          **extra)  # fmt: skip

    # ---------------------------------------------------------------- steps

    def apply(self, b: EventBatch) -> None:
        self.log.append(f"consume {b!r}")
        out = self.d.consume(b)
        assert out.value == "applied", out
        self.m.consume(b)

    def body(self, inst: str) -> None:
        """1-3 batches of one emitter as a decoded JSON body (store runs, columns)."""
        r = self.rng
        place = r.choice(PLACES)
        kinds = [r.choice(["store", "store", "store", "delete", "access"])
                 for _ in range(r.randint(1, 3))]  # fmt: skip
        batches = [self.batch(inst, k, place if r.random() < 0.8 else None) for k in kinds]
        if r.random() < 0.3:  # a run of fresh chunks of one shape (StoreRules.store_run)
            k0 = self.key()
            hashes = self.unheld(6)
            cut = r.randint(0, len(hashes))
            batches = [
                self.batch(
                    inst,
                    "store",
                    place,
                    [
                        CacheEntry(
                            ObjectKey(
                                h, k0.model_name, k0.kv_rank, k0.object_group_id, k0.cache_salt
                            ),
                            2,
                            r.choice(PROBES),
                            r.choice(OFFSETS),
                        )
                        for h in part
                    ],
                )
                for part in (hashes[:cut], hashes[cut:])
                if part
            ]
        self.log.append(f"apply_columns {batches!r}")
        outs = self.d.apply_columns(decode_json_columns(encode_json(batches)))
        assert [o.value for o in outs] == ["applied"] * len(batches), outs
        for b in batches:
            self.m.consume(b)

    def step(self) -> None:
        r = self.rng
        op = r.choice(
            ["store"] * 4 + ["body"] * 3 + ["delete"] * 2
            + ["access", "resync", "resync", "fence", "deregister", "restart", "snapshot", "capture"]
        )  # fmt: skip
        inst = r.choice(INSTANCES)
        if op in ("store", "delete", "access", "resync"):
            self.apply(self.batch(inst, op))
        elif op == "body":
            self.body(inst)
        elif op == "fence":
            self.log.append(f"fence {inst}")
            self.d.fence_instance(inst)
            self.m.fence(inst)
        elif op == "deregister":
            self.log.append(f"deregister {inst}")
            self.d.deregister(inst)
            self.m.deregister(inst)
        elif op == "restart":
            self.log.append(f"restart {inst}")
            self.state[inst] = [self.state[inst][0] + 1, 0]
            self.apply(self.batch(inst, "store"))
        elif op == "snapshot":
            self.log.append("snapshot")
            path = self.tmp / "dir.snap"
            save_snapshot(self.d, path)
            self.d = KeyDirectory(CS, enable_blend_lookup=True)
            load_snapshot(self.d, path)
            self.m.cursors = {i: c for i, c in self.m.cursors.items()}
        elif op == "capture":
            self.capture()
        check(self.d, self.m, f"after {op} (step {len(self.log)})")

    def capture(self) -> None:
        """A snapshot whose capture sees changes between partitions: it restores the state
        at capture start; the live directory goes on."""
        self.log.append("capture")
        start = copy.deepcopy(self.m)
        at = sorted(self.rng.sample(range(256), 3))
        original = Capture.parts
        run = self

        def parts(capture: Capture) -> Iterator[CapturedPart]:
            for part_no, part in enumerate(original(capture)):
                yield part
                if part_no in at:
                    for _ in range(run.rng.randint(1, 3)):
                        inst = run.rng.choice(INSTANCES)
                        kind = run.rng.choice(["store", "store", "delete", "resync", "access"])
                        run.apply(run.batch(inst, kind))
                    if run.rng.random() < 0.3:
                        inst = run.rng.choice(INSTANCES)
                        run.log.append(f"fence {inst}")
                        run.d.fence_instance(inst)
                        run.m.fence(inst)

        path = self.tmp / "cap.snap"
        Capture.parts = parts  # type: ignore[method-assign, assignment]
        try:
            save_snapshot(self.d, path)
        finally:
            Capture.parts = original  # type: ignore[method-assign, assignment]
        check(self.d, self.m, "live after capture")
        other = KeyDirectory(CS, enable_blend_lookup=True)
        load_snapshot(other, path)
        check(other, start, "restored capture")


SEEDS = int(os.environ.get("REVIEW_SEEDS", "40"))
SEED0 = int(os.environ.get("REVIEW_SEED0", "0"))
STEPS = int(os.environ.get("REVIEW_STEPS", "40"))


def run_seed(seed: int, tmp: Path, steps: int = STEPS, blend: bool = True) -> Run:
    """Blend off: until the first snapshot step, whose restore (blend on) indexes it all."""
    run = Run(seed, tmp, blend)
    try:
        for _ in range(steps):
            run.step()
    except AssertionError:
        print("\n".join(run.log[-12:]))
        raise
    return run


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + SEEDS))
def test_per_salt_bindings_equal_a_naive_model(seed: int, tmp_path: Path) -> None:
    run_seed(seed, tmp_path)


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + SEEDS // 4))
def test_per_salt_bindings_bound_with_blend_off_are_indexed_by_a_restore(
    seed: int, tmp_path: Path
) -> None:
    run_seed(seed + 50_000, tmp_path, blend=False)


# ---------------------------------------------------------------------------------------------
# Reproductions of the defects a review of the per-salt bindings found (each failed before its fix).

X = np.array([1, 2, 3, 4], np.uint32)
H1 = bytes([1]) * 32


def _key(salt: str, h: bytes = H1) -> ObjectKey:
    return ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0), 0, salt)


def _store(d: KeyDirectory, inst: str, salt: str, ids: Any, offset: int, seq: int = 1) -> None:
    e = CacheEntry(_key(salt), 10, ids, offset)
    assert d.consume(EventBatch(inst, 1, seq, "store", "l2", "fs", False, 0.0, (e,))).value == (
        "applied"
    )


def test_another_tenants_equal_ids_at_another_offset_do_not_change_my_matches() -> None:
    """Tenant b stores its own key under a guessed chunk hash with the guessed ids and blend-
    matches them in its own namespace: a miss tells it that another tenant holds that chunk
    with those ids at another offset (and at which offset, trying a few), and it takes a's
    matches away (tenant_bindings.claims drops both)."""
    alone = KeyDirectory(CS, enable_blend_lookup=True)
    _store(alone, "b", "b", X, 8)
    both = KeyDirectory(CS, enable_blend_lookup=True)
    _store(both, "a", "a", X, 4)
    _store(both, "b", "b", X, 8)
    ns_b = BlendNamespace("m", "b")
    assert [m.old_st for m in alone.blend_match(X, ns_b)] == [8]
    assert [m.old_st for m in both.blend_match(X, ns_b)] == [8]
    assert [m.old_st for m in both.blend_match(X, BlendNamespace("m", "a"))] == [4]


def test_another_tenants_equal_ids_without_offset_do_not_take_my_matches() -> None:
    """Even without the index change: b's binding at offset -1 is never indexed, so there is
    no occupant offset to disagree on; claims() drops a's claim all the same."""
    d = KeyDirectory(CS, enable_blend_lookup=True)
    _store(d, "a", "a", X, 4)
    _store(d, "b", "b", X, -1)
    assert [m.old_st for m in d.blend_match(X, BlendNamespace("m", "a"))] == [4]


def test_eviction_position_of_a_chunk_of_two_salts_is_its_salts_offset() -> None:
    d = KeyDirectory(CS)
    _store(d, "a", "a", X, 3 * CS)
    assert [k.position for k in d.keys_of_salts(["a"])["a"]] == [3]
    _store(d, "b", "b", None, -1)  # another tenant's key: a's eviction order must not move
    assert [k.position for k in d.keys_of_salts(["a"])["a"]] == [3]


def _tampered(d: KeyDirectory, path: Path, edit: Callable[[list[Any]], list[Any]]) -> Path:
    import msgspec

    from kvatlas.directory.snapshot.format import PREFIX, Header
    from tests.directory.helpers import sealed

    save_snapshot(d, path)
    raw = path.read_bytes()
    _, n = PREFIX.unpack_from(raw)
    header = msgspec.msgpack.decode(raw[PREFIX.size : PREFIX.size + n], type=Header[bytes])
    header.tenant_bindings = edit(list(header.tenant_bindings))
    encoded = msgspec.msgpack.encode(header)
    path.write_bytes(sealed(PREFIX.pack(raw[:8], len(encoded)) + encoded + raw[PREFIX.size + n :]))
    return path


def _refused(path: Path) -> bool:
    from kvatlas.directory.snapshot.format import SnapshotError

    d = KeyDirectory(CS)
    e = CacheEntry(_key("keep", bytes([9]) * 32), 10, None, -1)
    d.consume(EventBatch("z", 1, 1, "store", "l2", "fs", False, 0.0, (e,)))
    try:
        load_snapshot(d, path)
    except SnapshotError:
        assert [k.key for k in d.list_keys().items] == [e.key]  # nothing installed
        return True
    return False


def test_a_tenant_row_with_a_bad_offset_is_refused(tmp_path: Path) -> None:
    d = KeyDirectory(CS)
    _store(d, "a", "a", X, 4)
    _store(d, "b", "b", None, -1)
    assert _refused(_tampered(d, tmp_path / "s", lambda rows: [(*r[:3], -2) for r in rows]))


def test_a_tenant_row_of_a_salt_without_keys_of_the_chunk_is_refused(tmp_path: Path) -> None:
    d = KeyDirectory(CS)
    _store(d, "a", "a", X, 4)
    _store(d, "b", "b", None, -1)
    junk = np.array([6, 6, 6, 6], "<u4").tobytes()
    assert _refused(_tampered(d, tmp_path / "s", lambda rows: [*rows, (H1, "zz", junk, 0)]))


def test_a_duplicate_tenant_row_is_refused(tmp_path: Path) -> None:
    d = KeyDirectory(CS)
    _store(d, "a", "a", X, 4)
    _store(d, "b", "b", None, -1)
    junk = np.array([7, 7, 7, 7], "<u4").tobytes()
    assert _refused(_tampered(d, tmp_path / "s", lambda rows: [*rows, (H1, "a", junk, 0)]))


def test_a_tenant_row_is_refused_when_no_chunk_has_two_keys(tmp_path: Path) -> None:
    d = KeyDirectory(CS)
    _store(d, "a", "a", X, 4)
    assert _refused(_tampered(d, tmp_path / "s", lambda rows: [(H1, "b", X.tobytes(), 0)]))


def test_blend_enabled_later_a_re_store_indexes_a_chunk_of_two_salts() -> None:
    """As a chunk of one salt: bound while blend was off, a later token-bearing store indexes
    it (docs: "not retroactive ... until a later token-bearing store")."""
    d = KeyDirectory(CS)
    _store(d, "a", "a", X, 8)
    _store(d, "b", "b", None, -1)
    d.enable_blend_lookup()
    _store(d, "a", "a", X, 8, seq=2)
    assert [m.old_st for m in d.blend_match(X, BlendNamespace("m", "a"))] == [8]
