"""An event's new blocks of a plain chain are stored as one run (``Rekeyer._stored_run``): for
any program of engine batches — chains continued inside and across chunks, in events of one
block or many, re-stores, unknown parents, extra keys and adapters, both media, removals,
clears, a block map small enough to evict, either scheme — the re-keyer must yield the same
ops and keep the same block map (entries, order, counters) as the block-by-block loop."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.kv_events import rekey
from kvatlas.coordinator.kv_events.batch_checks import BadBatch
from kvatlas.coordinator.kv_events.changes import Cleared
from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from kvatlas.keys import KeyScheme

CHUNK = 16

stored = st.tuples(
    st.just("store"),
    st.integers(0, 40),  # parent: 0 none, 1 an unknown hash, else a stored block (mod count)
    st.integers(1, 9),  # blocks
    st.sampled_from([4, 8]),  # block size
    st.integers(0, 9),  # 0: each block a hash already stored (a re-store), 1: one repeated
    st.sampled_from(["GPU", "CPU"]),
    st.integers(0, 12),  # 0: extra keys on a block, 1: an adapter
)
removed = st.tuples(st.just("remove"), st.integers(0, 1000), st.sampled_from(["GPU", "CPU"]))
events = st.one_of(stored, stored, stored, removed, st.just(("clear",)))
programs = st.lists(st.lists(events, min_size=1, max_size=4), min_size=1, max_size=14)


def events_of(
    batch: list[tuple[Any, ...]], seen: list[BlockHash], fresh: list[int]
) -> list[KVEvent]:
    out: list[KVEvent] = []
    for op in batch:
        if op[0] == "clear":
            out.append(AllBlocksCleared())
            continue
        if op[0] == "remove":
            if seen:
                out.append(BlockRemoved([seen[op[1] % len(seen)]], op[2]))
            continue
        _, parent, n, size, repeat, medium, extra = op
        fresh[0] += 1
        hashes: list[BlockHash] = [
            bytes([fresh[0] % 256, fresh[0] // 256, i]) * 4 for i in range(n)
        ]
        if repeat == 0 and seen:
            hashes = [seen[(parent + i) % len(seen)] for i in range(n)]
        elif repeat == 1 and n > 1:
            hashes[-1] = hashes[0]
        parent_hash = (
            None if parent == 0 or not seen else b"unknown" if parent == 1
            else seen[parent % len(seen)]
        )  # fmt: skip
        tokens = [(parent * 7919 + fresh[0] * 104729 + k) % 200_000 for k in range(n * size)]
        out.append(BlockStored(
            hashes, parent_hash, tokens, size, medium=medium,
            extra_keys=[["img", i] if i == 1 else None for i in range(n)] if extra == 0 else None,
            lora_name="adapter" if extra == 1 else None,
        ))  # fmt: skip
        seen += hashes
    return out


def comparable(op: Any) -> tuple[Any, ...]:
    if isinstance(op, Cleared):
        return ("cleared", op.instance_id)
    h = op.batch()
    entries = [
        (e.key, e.token_offset, None if e.token_ids is None else e.token_ids.tolist())
        for e in h.entries
    ]
    return (h.instance_id, h.seq, h.event_type, h.tier, entries)


def translated(
    runs: bool, program: list[list[tuple[Any, ...]]], scheme: str, max_blocks: int
) -> tuple[list[Any], list[Any], dict[str, int], int]:
    rekeyer = rekey.Rekeyer(KeyScheme(scheme, CHUNK), max_blocks)
    seen: list[BlockHash] = []
    fresh = [0]
    ops: list[Any] = []
    saved, rekey.RUNS = rekey.RUNS, runs
    try:
        for ts, batch in enumerate(program, 1):
            try:
                got = rekeyer.translate(
                    "pod-a", "m", KVEventBatch(float(ts), events_of(batch, seen, fresh))
                )
            except BadBatch as exc:
                ops.append(("bad", exc.kind))
                continue
            ops += [comparable(op) for op in got]
    finally:
        rekey.RUNS = saved
    blocks = list(rekeyer.engine("pod-a").blocks.items())
    return ops, blocks, dict(rekeyer.counts), rekeyer.total_blocks


@settings(max_examples=200, deadline=None)
@given(programs, st.sampled_from(["blake3", "blake3-x1"]), st.sampled_from([1000, 40, 12]))
@example(  # a run completing two chunks after a partial one, then continued one block at a time
    [[("store", 0, 3, 4, 5, "GPU", 5)], [("store", 2, 9, 4, 5, "GPU", 5)],
     [("store", 12, 1, 4, 5, "CPU", 5)]],
    "blake3", 1000,
)  # fmt: skip
def test_runs_translate_as_the_block_loop_does(
    program: list[list[tuple[Any, ...]]], scheme: str, max_blocks: int
) -> None:
    assert translated(True, program, scheme, max_blocks) == translated(
        False, program, scheme, max_blocks
    )


def test_a_run_is_taken_and_completes_chunks_across_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run path is the one taken for a plain event of many new blocks (not a vacuous
    comparison): it keys the chunks an oracle of the whole chain names."""
    taken: list[int] = []
    original = rekey.Rekeyer._stored_run

    def spy(self: rekey.Rekeyer, state: Any, model: str, hashes: list[Any], *rest: Any) -> None:
        taken.append(len(hashes))
        original(self, state, model, hashes, *rest)

    monkeypatch.setattr(rekey.Rekeyer, "_stored_run", spy)
    program = [[("store", 0, 3, 4, 5, "GPU", 5)], [("store", 2, 9, 4, 5, "GPU", 5)]]
    ops, _, counts, total = translated(True, program, "blake3", 1000)
    assert taken == [3, 9] and counts["chunks_stored"] == 3 and total == 12
    assert [len(op[4]) for op in ops] == [3]  # one store batch of the three chunks
