"""Ingest gate semantics, case by case (docs/directory.md), on the gate and via the directory."""

from collections import Counter

from kvatlas.directory import IngestGate, KeyDirectory, Outcome
from kvatlas.events import EventBatch
from tests.directory.helpers import Emitter, entry, key


def b(inc: int, seq: int, inst: str = "a") -> EventBatch:
    return EventBatch(inst, inc, seq, "access", "l1")


def feed(gate: IngestGate, batch: EventBatch) -> Outcome:
    adm = gate.admit(batch)
    gate.commit(batch, adm)
    return adm.outcome


def test_in_order_batches_apply() -> None:
    gate = IngestGate()
    assert [feed(gate, b(1, s)) for s in (1, 2, 3)] == [Outcome.APPLIED] * 3
    cur = gate.cursor("a")
    assert cur is not None and (cur.incarnation, cur.last_seq, cur.gaps) == (1, 3, 0)


def test_lower_incarnation_is_stale_and_changes_nothing() -> None:
    gate = IngestGate()
    feed(gate, b(5, 1))
    assert feed(gate, b(4, 9)) is Outcome.STALE
    cur = gate.cursor("a")
    assert cur is not None and (cur.incarnation, cur.last_seq) == (5, 1)


def test_duplicate_even_with_different_payload() -> None:
    gate = IngestGate()
    feed(gate, b(1, 1))
    feed(gate, b(1, 2))
    other = EventBatch("a", 1, 2, "config", "l1", capacity_bytes=1, capacity_revision=1)
    assert gate.admit(other).outcome is Outcome.DUPLICATE
    assert feed(gate, b(1, 1)) is Outcome.DUPLICATE
    cur = gate.cursor("a")
    assert cur is not None and cur.last_seq == 2


def test_higher_incarnation_fences_first_and_resets_cursor() -> None:
    gate = IngestGate()
    feed(gate, b(1, 7))
    adm = gate.admit(b(2, 1))
    assert adm.outcome is Outcome.APPLIED and adm.fence_first and adm.missing == 0
    gate.commit(b(2, 1), adm)
    cur = gate.cursor("a")
    assert cur is not None and (cur.incarnation, cur.last_seq) == (2, 1)
    assert feed(gate, b(1, 8)) is Outcome.STALE


def test_gap_is_applied_and_recorded_per_emitter() -> None:
    gate = IngestGate()
    feed(gate, b(1, 1))
    assert feed(gate, b(1, 4)) is Outcome.APPLIED
    feed(gate, b(1, 1, inst="other"))
    cur = gate.cursor("a")
    assert cur is not None
    assert (cur.last_seq, cur.gaps, cur.missing_batches) == (4, 1, 2)
    assert cur.last_gap is not None and (cur.last_gap.after_seq, cur.last_gap.seq) == (1, 4)
    other = gate.cursor("other")
    assert other is not None and other.gaps == 0
    assert feed(gate, b(1, 3)) is Outcome.DUPLICATE  # a late batch from inside the gap


def test_first_batch_after_seq_one_is_a_gap_and_forget_resets() -> None:
    gate = IngestGate()
    feed(gate, b(1, 3))
    cur = gate.cursor("a")
    assert cur is not None and cur.missing_batches == 2
    gate.forget("a")
    assert gate.cursor("a") is None
    assert feed(gate, b(0, 1)) is Outcome.APPLIED  # forgotten: even a lower incarnation is new


def test_directory_gate_outcomes_and_fencing() -> None:
    d = KeyDirectory(4)
    em = Emitter("a")
    first = em.batch("store", [entry(key(1))])
    assert d.consume(first) is Outcome.APPLIED
    assert d.consume(first) is Outcome.DUPLICATE
    l2 = em.batch("store", [entry(key(2))], tier="l2", backend="fs")
    assert d.consume(l2) is Outcome.APPLIED
    old = Emitter("a", incarnation=0)
    assert d.consume(old.batch("delete", [entry(key(2))], tier="l2", backend="fs")) is Outcome.STALE
    assert d.lookup([key(2)])[0].placements  # the stale delete changed nothing
    em.restart()
    assert d.consume(em.batch("store", [entry(key(3))])) is Outcome.APPLIED
    got = {kp.key: len(kp.placements) for kp in d.lookup([key(1), key(2), key(3)])}
    assert got == {key(1): 0, key(2): 1, key(3): 1}  # L1 of the old incarnation fenced
    counts = Counter(d.consume(b) for b in [em.batch("access"), first, old.batch("access")])
    assert (counts[Outcome.APPLIED], counts[Outcome.DUPLICATE], counts[Outcome.STALE]) == (1, 0, 2)


def test_directory_gap_visible_and_deregister_forgets() -> None:
    d = KeyDirectory(4)
    em = Emitter("a")
    d.consume(em.batch("store", [entry(key(1))]))
    em.seq += 5
    d.consume(em.batch("store", [entry(key(2))]))
    cur = d.gap_state("a")
    assert cur is not None and cur.gaps == 1 and cur.missing_batches == 5
    assert d.stats().gaps == 1
    assert d.deregister("a") == 2
    assert d.gap_state("a") is None
    assert all(not kp.placements for kp in d.lookup([key(1), key(2)]))


def test_missing_batches_saturate_at_the_largest_count_a_snapshot_holds() -> None:
    """An engine whose seq jumps 0 → 2^63−1 → 0 → … (each jump back a new incarnation) made
    ``missing_batches`` grow past 2^64, which no snapshot can encode: the snapshot thread
    died. The count stops at 2^64 − 1 (as many batches as a seq can name)."""
    gate = IngestGate()
    for incarnation in range(1, 7):
        feed(gate, b(incarnation, 2**63 - 1))
    cur = gate.cursor("a")
    assert cur is not None and cur.missing_batches == 2**64 - 1 and cur.gaps == 6
