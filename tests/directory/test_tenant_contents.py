"""A chunk hash is shared by every tenant that stores the same text (the salt is part of the
key, not of the hash), and so is the content the directory binds to it. A store under one
namespace whose ids differ from the bound content (an emitter that lies, or is broken) may
rebind it only while no other namespace holds keys of the chunk: else the binding stays,
counted (``content_conflicts``), and the other tenants' matches, reuse and key lookups are
untouched (spec keys.md §2: a tenant's salt is isolated). Within one namespace the store
rebinds, as it always did (the last writer wins)."""

from __future__ import annotations

from kvatlas.directory import KeyDirectory
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, entry, key, toks

A, B = BlendNamespace("m", "tenant-a"), BlendNamespace("m", "tenant-b")
OURS, FORGED = toks(11, 12, 13, 14), toks(900, 901, 902, 903)


def matches(d: KeyDirectory, content: object, ns: BlendNamespace) -> set[tuple[bytes, int]]:
    return {(m.chunk_hash, m.old_st) for m in d.blend_match(content, ns)}  # type: ignore[arg-type]


def test_another_namespaces_store_of_other_ids_does_not_rebind_the_chunk() -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    a, b = Emitter("a"), Emitter("b")
    h = key(1).chunk_hash
    d.consume(a.batch("store", [entry(key(1, salt="tenant-a"), OURS, 0)]))
    assert matches(d, OURS, A) == {(h, 0)}
    d.consume(b.batch("store", [entry(key(1, salt="tenant-b"), FORGED, 0)]))
    assert matches(d, OURS, A) == {(h, 0)}  # A's reuse stays
    assert matches(d, FORGED, A) == set()  # and A never matches ids it did not store
    assert matches(d, FORGED, B) == set()
    (kp,) = d.lookup([key(1, salt="tenant-a")])
    assert kp.content is not None and kp.content.tolist() == OURS.tolist()
    assert d.stats().content_conflicts == 1
    # once tenant A's keys are gone, B's namespace alone holds the chunk: its store rebinds
    d.consume(a.batch("delete", [entry(key(1, salt="tenant-a"))]))
    d.consume(b.batch("store", [entry(key(1, salt="tenant-b"), FORGED, 0)]))
    assert matches(d, FORGED, B) == {(h, 0)} and matches(d, OURS, B) == set()
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
