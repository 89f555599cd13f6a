"""A chunk hash is shared by every tenant that stores the same text (the salt is part of the
key, not of the hash). What a tenant sees of a chunk must not depend on another tenant's data
(spec keys.md §2: a tenant's salt is isolated): while a chunk's keys span several salts each
salt has its own binding (directory/tenant_bindings.py), so a tenant storing a key of its own
salt under another tenant's chunk hash — with no ids, junk ones or the same ones — reads back,
matches and keeps out nothing of the other's. Within one salt, a store of other ids by another
namespace (another model or world size) leaves the binding, counted (``content_conflicts``);
within one namespace the last writer rebinds, as it always did."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, entry, key, toks

A, B = BlendNamespace("m", "tenant-a"), BlendNamespace("m", "tenant-b")
OURS, FORGED = toks(11, 12, 13, 14), toks(900, 901, 902, 903)


def matches(d: KeyDirectory, content: object, ns: BlendNamespace) -> set[tuple[bytes, int]]:
    return {(m.chunk_hash, m.old_st) for m in d.blend_match(content, ns)}  # type: ignore[arg-type]


def contents(d: KeyDirectory, *salts: str) -> list[list[int] | None]:
    """What each salt's key of chunk 1 reads back, by lookup and by listing."""
    looked = [kp.content for kp in d.lookup([key(1, salt=s) for s in salts])]
    listed = {kp.key.cache_salt: kp.content for kp in d.list_keys(limit=100).items}
    for salt, content in zip(salts, looked, strict=True):
        other = listed.get(salt)
        assert (content is None and other is None) or (
            content is not None and other is not None and content.tolist() == other.tolist()
        )
    return [None if c is None else c.tolist() for c in looked]


@pytest.mark.parametrize("ids", [None, FORGED, OURS], ids=["no-ids", "junk", "same-ids"])
@pytest.mark.parametrize("first", ["a", "b"], ids=["a-first", "b-first"])
def test_a_tenant_sees_nothing_of_another_tenants_binding(ids: object, first: str) -> None:
    """Tenant B stores a key of its own salt under tenant A's chunk hash, before or after A:
    B reads back and matches only what B stored, A only what A stored (B's view equals the
    one it has of a directory without A, the other way round too)."""
    d = KeyDirectory(CS, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    h = key(1).chunk_hash
    stores = {
        "a": lambda: d.consume(a.batch("store", [entry(key(1, salt="tenant-a"), OURS, 0)])),
        "b": lambda: d.consume(b.batch("store", [entry(key(1, salt="tenant-b"), ids, 0)])),
    }
    for who in (first, "b" if first == "a" else "a"):
        stores[who]()
    b_ids = None if ids is None else ids.tolist()  # type: ignore[attr-defined]
    assert contents(d, "tenant-a", "tenant-b") == [OURS.tolist(), b_ids]
    assert matches(d, OURS, A) == {(h, 0)}
    assert matches(d, FORGED, A) == set()
    assert matches(d, OURS, B) == ({(h, 0)} if ids is OURS else set())
    assert matches(d, FORGED, B) == ({(h, 0)} if ids is FORGED else set())
    assert d.stats().content_conflicts == 0  # (another salt's ids are no conflict)
    assert d.stats().bound_chunks == 1
    # B's keys gone: A's chunk is back to one salt, A's binding in its record
    d.consume(b.batch("delete", [entry(key(1, salt="tenant-b"))]))
    assert contents(d, "tenant-a", "tenant-b") == [OURS.tolist(), None]
    assert matches(d, OURS, A) == {(h, 0)} and matches(d, FORGED, B) == set()
    assert d._chunks.tenants.rows == {}


def test_equal_ids_of_two_salts_at_two_offsets_are_each_matched_at_their_own() -> None:
    """The index keeps one offset per (content, chunk hash): each salt's binding of a chunk of
    several salts is indexed under an occupant of its own, so B's equal ids at another offset
    never answer A's matches with B's ``old_st`` (wrong KV after re-RoPE), nor take them away
    (which would tell B that A holds them); once B leaves, A's are under the chunk hash."""
    d = KeyDirectory(CS, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    h = key(1).chunk_hash
    d.consume(a.batch("store", [entry(key(1, salt="tenant-a"), OURS, 0)]))
    d.consume(b.batch("store", [entry(key(1, salt="tenant-b"), OURS, 8)]))
    assert matches(d, OURS, A) == {(h, 0)} and matches(d, OURS, B) == {(h, 8)}
    assert contents(d, "tenant-a", "tenant-b") == [OURS.tolist(), OURS.tolist()]
    d.consume(b.batch("store", [entry(key(1, salt="tenant-b"), OURS, -1)]))  # no news
    assert matches(d, OURS, A) == {(h, 0)} and matches(d, OURS, B) == {(h, 8)}
    d.consume(b.batch("delete", [entry(key(1, salt="tenant-b"))]))
    assert matches(d, OURS, A) == {(h, 0)} and matches(d, OURS, B) == set()
    assert d.stats().blend.occupants == 1  # type: ignore[union-attr]


def test_per_salt_bindings_survive_a_snapshot(tmp_path: Path) -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    h = key(1).chunk_hash
    d.consume(a.batch("store", [entry(key(1, salt="tenant-a"), OURS, 0)]))
    d.consume(b.batch("store", [entry(key(1, salt="tenant-b"), FORGED, 4)]))
    d.consume(b.batch("store", [entry(key(1, salt="tenant-c"))]))
    save_snapshot(d, tmp_path / "s.snap")
    for blend in (True, False):
        e = KeyDirectory(CS, enable_blend_lookup=blend)
        load_snapshot(e, tmp_path / "s.snap")
        assert contents(e, "tenant-a", "tenant-b", "tenant-c") == [
            OURS.tolist(), FORGED.tolist(), None,
        ]  # fmt: skip
        if blend:
            assert matches(e, OURS, A) == {(h, 0)} and matches(e, FORGED, B) == {(h, 4)}
            assert matches(e, FORGED, A) == set() and matches(e, OURS, B) == set()
        # (a restart of b: its L1 copies fenced, the chunk back to tenant A alone)
        e.consume(Emitter("b", incarnation=9).batch("delete", [entry(key(1, salt="tenant-b"))]))
        e.consume(Emitter("b", incarnation=9).batch("delete", [entry(key(1, salt="tenant-c"))]))
        assert contents(e, "tenant-a", "tenant-b") == [OURS.tolist(), None]


def test_within_one_salt_another_namespaces_store_of_other_ids_does_not_rebind() -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    h = key(1).chunk_hash
    other = BlendNamespace("x", "tenant-a")
    d.consume(a.batch("store", [entry(key(1, salt="tenant-a"), OURS, 0)]))
    d.consume(b.batch("store", [entry(key(1, model="x", salt="tenant-a"), FORGED, 0)]))
    assert matches(d, OURS, A) == {(h, 0)} and matches(d, OURS, other) == {(h, 0)}
    assert matches(d, FORGED, A) == set() and matches(d, FORGED, other) == set()
    assert d.stats().content_conflicts == 1
    # once model m's keys are gone, model x's namespace alone holds the chunk: it rebinds
    d.consume(a.batch("delete", [entry(key(1, salt="tenant-a"))]))
    d.consume(b.batch("store", [entry(key(1, model="x", salt="tenant-a"), FORGED, 0)]))
    assert matches(d, FORGED, other) == {(h, 0)} and matches(d, OURS, other) == set()
    assert d.stats().content_conflicts == 1


def test_within_one_namespace_the_last_writer_rebinds() -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    h = key(1).chunk_hash
    ns = BlendNamespace("m")
    d.consume(a.batch("store", [entry(key(1), OURS, 0)]))
    d.consume(b.batch("store", [entry(key(1, rank=0), FORGED, 4)]))  # another node, same tenant
    assert matches(d, FORGED, ns) == {(h, 4)} and matches(d, OURS, ns) == set()
    assert d.stats().content_conflicts == 0
