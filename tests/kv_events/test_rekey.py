"""Re-keying vLLM blocks into kvatlas chunks (docs/kv-events.md): chunks from token chains,
partial chunks held, unknown parents counted, MM/LoRA under both schemes, BlockRemoved through
the bounded map, AllBlocksCleared, and bad batches refused whole."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvatlas.coordinator.kv_events import BadBatch, Cleared, Rekeyer, SubscriberStats
from kvatlas.directory import load_snapshot, save_snapshot
from kvatlas.events import CacheEntry, ColumnBatch, EventBatch
from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from kvatlas.keys import BlendNamespace, KeyScheme, ObjectKey, chunk_hashes
from tests.kv_events.helpers import HASHES, TOKENS, apply, fed, golden_batch

TEXT = BlockStored(HASHES[:2], None, TOKENS[:32], 16, medium="GPU")
TEXT_MORE = BlockStored(HASHES[2:], HASHES[1], TOKENS[32:], 16, medium="GPU")


def batch(*events: object, dp: int | None = None) -> KVEventBatch:
    return KVEventBatch(1.0, list(events), dp)  # type: ignore[arg-type]


def holders(directory: object, tokens: list[int], model: str = "llama") -> dict[str, int]:
    found = directory.lookup_tokens(tokens, model)  # type: ignore[attr-defined]
    return {(h.instance_id, h.tier): h.chunks for h in found.prefix}


@pytest.mark.parametrize("name", ["current-stored", "legacy-array-stored"])
def test_golden_blocks_become_chunks_a_prefix_lookup_finds(name: str) -> None:
    rekeyer, directory = fed(chunk_size=32)
    apply(rekeyer, directory, "pod-a", "llama", golden_batch(name))
    # Blocks 0-1 (text, GPU) are chunk 0; blocks 2-3 carry a LoRA and an image: not under blake3.
    assert holders(directory, TOKENS) == {("pod-a", "gpu"): 1}
    assert rekeyer.counts["unindexable_chunks"] == 1
    key = directory.lookup_tokens(TOKENS[:32], "llama").results[0].key
    assert key.chunk_hash == chunk_hashes(np.array(TOKENS[:32]), 32)[0]


def test_a_partial_chunk_waits_for_its_last_block() -> None:
    rekeyer, directory = fed(chunk_size=64)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT))
    assert holders(directory, TOKENS) == {}
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT_MORE))
    assert holders(directory, TOKENS) == {("pod-a", "gpu"): 1}
    # Removing any block of the chunk removes the chunk.
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([HASHES[0]], "GPU")))
    assert holders(directory, TOKENS) == {}


def test_cpu_medium_is_the_engine_cpu_tier_and_removal_follows_the_medium() -> None:
    rekeyer, directory = fed(chunk_size=16)
    cpu = BlockStored(HASHES[:2], None, TOKENS[:32], 16, medium="CPU")
    apply(rekeyer, directory, "pod-a", "llama", batch(cpu))
    assert holders(directory, TOKENS) == {("pod-a", "engine-cpu"): 2}
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([HASHES[1]], "CPU")))
    assert holders(directory, TOKENS) == {("pod-a", "engine-cpu"): 1}


def test_an_unknown_parent_is_counted_and_never_guessed() -> None:
    rekeyer, directory = fed(chunk_size=16)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT_MORE))
    assert rekeyer.counts["unknown_parents"] == 1
    assert directory.stats().keys == 0


def test_all_blocks_cleared_drops_the_engine_and_its_block_map() -> None:
    rekeyer, directory = fed(chunk_size=16)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT))
    apply(rekeyer, directory, "pod-b", "llama", batch(TEXT))
    apply(rekeyer, directory, "pod-a", "llama", golden_batch("current-cleared"))
    assert holders(directory, TOKENS) == {("pod-b", "gpu"): 2}
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT_MORE))  # its parent is gone
    assert rekeyer.counts["unknown_parents"] == 1


def test_int_hashes_work_like_byte_hashes() -> None:
    rekeyer, directory = fed(chunk_size=16)
    apply(rekeyer, directory, "pod-a", "llama", golden_batch("current-int-hashes"))
    assert holders(directory, TOKENS) == {("pod-a", "gpu"): 2}
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([-42], "GPU")))
    assert holders(directory, TOKENS) == {("pod-a", "gpu"): 1}


def test_engine_text_chunks_feed_the_blend_index() -> None:
    rekeyer, directory = fed(chunk_size=16, blend=True)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT))
    query = [7] * 5 + TOKENS[16:32] + [9] * 3
    matches = directory.blend_match(np.array(query, dtype=np.uint32), BlendNamespace("llama"))
    assert [(m.cur_st, m.old_st) for m in matches] == [(5, 16)]


def mm_and_lora(scheme: str) -> tuple[Rekeyer, object, list[EventBatch]]:
    """The batches each engine's chain makes (as objects), applied as translated."""
    rekeyer, directory = fed(scheme, chunk_size=16, blend=True)
    ops = []
    for instance, event in (
        ("text", TEXT),
        ("image", msgspec.structs.replace(TEXT, extra_keys=[["img-1"], None])),
        ("lora", msgspec.structs.replace(TEXT, lora_name="adapter-a")),
    ):
        for op in rekeyer.translate(instance, "llama", batch(event)):
            assert isinstance(op, ColumnBatch)
            directory.apply_columns([op])
            ops.append(op.batch())
    return rekeyer, directory, ops


def test_mm_and_lora_chains_are_unindexable_under_blake3() -> None:
    rekeyer, directory, _ = mm_and_lora("blake3")
    assert holders(directory, TOKENS) == {("text", "gpu"): 2}
    assert rekeyer.counts["unindexable_chunks"] == 4  # image: both chunks (the chain); lora: 2


def test_mm_and_lora_get_their_own_keys_under_blake3_x1() -> None:
    _rekeyer, directory, ops = mm_and_lora("blake3-x1")
    keys = {op.instance_id: [e.key.chunk_hash for e in op.entries] for op in ops}
    text, image, lora = keys["text"], keys["image"], keys["lora"]
    assert text == KeyScheme("blake3-x1", 16).chunk_hashes(TOKENS[:32])
    assert len(set(text) | set(image) | set(lora)) == 6  # never a text key
    assert holders(directory, TOKENS) == {("text", "gpu"): 2}
    # LoRA under x1: the same key a node computes for the adapter; tokens never offered to blend.
    assert lora == KeyScheme("blake3-x1", 16).chunk_hashes(TOKENS[:32], (), {"lora": "adapter-a"})
    assert all(e.token_ids is None for op in ops if op.instance_id != "text" for e in op.entries)


def test_a_lora_appearing_mid_chain_is_never_keyed() -> None:
    rekeyer, _ = fed("blake3-x1", chunk_size=16)
    rekeyer.translate("pod-a", "llama", batch(TEXT))
    ops = rekeyer.translate(
        "pod-a", "llama", batch(msgspec.structs.replace(TEXT_MORE, lora_name="x"))
    )
    assert ops == [] and rekeyer.counts["unindexable_chunks"] == 2


def test_other_kv_cache_groups_are_skipped_and_counted() -> None:
    rekeyer, _ = fed(chunk_size=16)
    assert rekeyer.translate("p", "m", batch(msgspec.structs.replace(TEXT, group_idx=1))) == []
    assert rekeyer.counts["other_group_blocks"] == 2


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (msgspec.structs.replace(TEXT, block_size=0), "block_size"),
        (msgspec.structs.replace(TEXT, block_size=12), "block_size"),
        (msgspec.structs.replace(TEXT, block_size=1 << 40), "block_size"),
        (msgspec.structs.replace(TEXT, token_ids=[-1, *TOKENS[1:32]]), "token_range"),
        (msgspec.structs.replace(TEXT, token_ids=[1 << 32, *TOKENS[1:32]]), "token_range"),
        (msgspec.structs.replace(TEXT, token_ids=TOKENS[:31]), "invalid"),
        (msgspec.structs.replace(TEXT, extra_keys=[None]), "invalid"),
        (msgspec.structs.replace(TEXT, block_hashes=[b"", b"x"]), "invalid"),
        (BlockStored([], None, [], 16), "invalid"),
    ],
)
def test_a_bad_event_refuses_the_whole_batch(event: BlockStored, kind: str) -> None:
    rekeyer, _directory = fed(chunk_size=16)
    with pytest.raises(BadBatch) as err:
        rekeyer.translate("pod-a", "llama", batch(TEXT, AllBlocksCleared(), event))
    assert err.value.kind == kind
    assert rekeyer.engines == {} and rekeyer.total_blocks == 0


@pytest.mark.parametrize("size", [0, 16])
def test_a_tokenless_placeholder_is_counted_and_skipped_not_the_batch(size: int) -> None:
    """vLLM 0.33's offloading connector (``self_describing_kv_events`` off, its default)
    announces a CPU offload as ``BlockStored(token_ids=[], block_size=0, medium="CPU")`` — its
    ``simple_kv_offload`` with the block size — in the same batch as the step's GPU blocks: it
    cannot be re-keyed (no ids), so it is counted and skipped; the step's GPU blocks are not
    lost with it (the whole batch was refused as a bad block size, a gap)."""
    rekeyer, directory = fed(chunk_size=16)
    placeholder = BlockStored([HASHES[3]], None, [], size, medium="CPU", group_idx=0)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT, placeholder))
    assert holders(directory, TOKENS) == {("pod-a", "gpu"): 2}
    assert rekeyer.counts["tokenless_blocks"] == 1
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([HASHES[3]], "CPU")))
    assert holders(directory, TOKENS) == {("pod-a", "gpu"): 2}


def one_block_events() -> list[BlockStored]:
    """The blocks of TOKENS one event each, as vLLM's CPU offload sends them."""
    return [
        BlockStored(
            [h], HASHES[i - 1] if i else None, TOKENS[16 * i : 16 * (i + 1)], 16, medium="CPU"
        )
        for i, h in enumerate(HASHES)
    ]


def test_one_block_events_convert_together_and_key_as_one_event_would() -> None:
    """A group's token ids are converted at once; each event keeps its own tokens."""
    together, directory = fed(chunk_size=32)
    apply(together, directory, "pod-a", "llama", batch(*one_block_events()))
    alone, reference = fed(chunk_size=32)
    apply(alone, reference, "pod-a", "llama", batch(TEXT, TEXT_MORE))
    assert holders(directory, TOKENS) == {("pod-a", "engine-cpu"): len(HASHES) // 2}
    got = [r.key.chunk_hash for r in directory.lookup_tokens(TOKENS, "llama").results]
    want = [r.key.chunk_hash for r in reference.lookup_tokens(TOKENS, "llama").results]
    assert got == want


def test_a_bad_token_in_a_later_one_block_event_is_named_and_refuses_all() -> None:
    events = one_block_events()
    bad = len(events) - 1
    events[bad] = msgspec.structs.replace(events[bad], token_ids=[1 << 32] * 16)
    rekeyer, _ = fed(chunk_size=32)
    with pytest.raises(BadBatch) as err:
        rekeyer.translate("pod-a", "llama", batch(*events))
    assert err.value.kind == "token_range" and f"events[{bad}]" in str(err.value)
    assert rekeyer.engines == {} and rekeyer.total_blocks == 0


def test_a_flood_beyond_max_blocks_is_refused_whole() -> None:
    rekeyer, _ = fed(chunk_size=16, max_blocks=3)
    with pytest.raises(BadBatch) as err:
        rekeyer.translate("pod-a", "llama", batch(TEXT, TEXT_MORE))
    assert err.value.kind == "too_many_blocks" and rekeyer.total_blocks == 0


def test_the_block_map_is_bounded_and_evicted_chunks_leave_the_directory() -> None:
    rekeyer, directory = fed(chunk_size=16, max_blocks=3)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT))
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT_MORE))
    assert rekeyer.total_blocks == 3 and rekeyer.counts["evicted_blocks"] == 1
    # Block 0 went first, and its chunk with it: the prefix now starts with nothing.
    assert holders(directory, TOKENS) == {}
    assert directory.stats().keys == 3


def test_a_restart_opens_a_new_incarnation_that_fences_the_old_one() -> None:
    rekeyer, directory = fed(chunk_size=16)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT, TEXT_MORE))
    rekeyer.restart("pod-a")
    apply(rekeyer, directory, "pod-a", "llama", batch(msgspec.structs.replace(TEXT_MORE,
          parent_block_hash=None, token_ids=[5] * 32)))  # fmt: skip
    assert holders(directory, TOKENS) == {}
    assert directory.stats().keys == 2


def test_cleared_is_an_op_in_order() -> None:
    rekeyer, _ = fed(chunk_size=16)
    ops = rekeyer.translate("pod-a", "llama", batch(TEXT, AllBlocksCleared(), TEXT))
    assert [type(op).__name__ for op in ops] == ["ColumnBatch", "Cleared", "ColumnBatch"]
    assert isinstance(ops[1], Cleared) and ops[1].instance_id == "pod-a"
    assert [op.header.seq for op in ops if isinstance(op, ColumnBatch)] == [1, 2]


def test_engine_tiers_survive_a_snapshot_and_are_fenced_after_it(tmp_path: Path) -> None:
    rekeyer, directory = fed(chunk_size=16)
    cpu = msgspec.structs.replace(TEXT_MORE, medium="CPU")
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT, cpu))
    save_snapshot(directory, tmp_path / "d.snap")
    _, restored = fed(chunk_size=16)
    load_snapshot(restored, tmp_path / "d.snap")
    assert holders(restored, TOKENS) == {("pod-a", "gpu"): 2}
    assert restored.stats().bytes_by_tier.keys() >= {"gpu", "engine-cpu"}
    assert restored.stats().l1_placements_by_instance == {"pod-a": 4}
    assert restored.fence_instance("pod-a") == 4
    assert restored.stats().keys == 0


def test_any_extra_key_value_is_an_identity_and_a_bad_ts_refuses_the_batch() -> None:
    rekeyer, _ = fed("blake3-x1", chunk_size=16)
    odd = msgspec.structs.replace(TEXT, extra_keys=[[{1: b"\x00"}, 7, None], [["a", 1.5]]])
    (op,) = rekeyer.translate("pod-a", "llama", batch(odd))
    assert isinstance(op, ColumnBatch) and op.n_entries == 2
    with pytest.raises(BadBatch):
        rekeyer.translate("pod-a", "llama", KVEventBatch(float("nan"), [TEXT]))


def test_every_rekeyer_counter_is_a_reported_field() -> None:
    names = {f.name for f in dataclasses.fields(SubscriberStats)}
    counted = {
        "clears", "blocks_stored", "blocks_removed", "chunks_stored", "chunks_removed",
        "unknown_parents", "unknown_removed_blocks", "unindexable_chunks",
        "other_group_blocks", "evicted_blocks",
    }  # fmt: skip
    assert counted <= names
    rekeyer, directory = fed(chunk_size=16, max_blocks=3)
    apply(rekeyer, directory, "p", "m", batch(TEXT, BlockRemoved([b"?" * 32])))
    apply(rekeyer, directory, "p", "m", batch(TEXT_MORE, BlockRemoved([HASHES[3]])))
    apply(rekeyer, directory, "p", "m", batch(msgspec.structs.replace(TEXT, group_idx=3)))
    apply(rekeyer, directory, "p", "m", batch(AllBlocksCleared()))
    assert set(rekeyer.counts) <= names


def test_a_gpu_eviction_leaves_the_cpu_offload_copy() -> None:
    rekeyer, directory = fed(chunk_size=32)
    apply(rekeyer, directory, "pod-a", "llama", batch(TEXT))  # GPU
    apply(rekeyer, directory, "pod-a", "llama", batch(msgspec.structs.replace(TEXT, medium="CPU")))
    found = directory.lookup_tokens(TOKENS, "llama")
    assert sorted((h.tier, h.chunks) for h in found.prefix) == [("engine-cpu", 1), ("gpu", 1)]
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([HASHES[0]], "GPU")))
    assert holders(directory, TOKENS) == {("pod-a", "engine-cpu"): 1}
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([HASHES[0]], "GPU")))  # again
    assert rekeyer.counts["unknown_removed_blocks"] == 1
    apply(rekeyer, directory, "pod-a", "llama", batch(BlockRemoved([HASHES[1]], "CPU")))
    assert holders(directory, TOKENS) == {}
    assert rekeyer.total_blocks == 2  # block 0 still on CPU, block 1 still on GPU


def test_the_block_map_of_text_chains_is_invisible_to_the_cyclic_collector() -> None:
    """Like the directory's records: at 500,000 blocks a block map the
    collector tracks added ≈0.5 s to every full collection, a stall for every client."""
    import gc

    rng = np.random.default_rng(0)
    rekeyer = Rekeyer(KeyScheme("blake3", 64), 10_000)
    n_blocks = 0
    for _ in range(40):  # chains of 12 blocks (3 chunks each), half of them continued later
        hashes = [rng.bytes(32) for _ in range(12)]
        ids = rng.integers(0, 150_000, 12 * 16).tolist()
        events = [BlockStored(hashes[:6], None, ids[: 6 * 16], 16, medium="GPU")]
        events += [BlockStored([h], hashes[5 + i], ids[(6 + i) * 16 : (7 + i) * 16], 16)
                   for i, h in enumerate(hashes[6:])]  # fmt: skip
        for event in events:
            rekeyer.translate("pod-a", "llama", batch(event))
        n_blocks += 12
    rekeyer.translate("pod-a", "llama", batch(BlockRemoved(HASHES[:1], "GPU")))  # unknown: counted
    assert rekeyer.total_blocks == n_blocks
    for _ in range(3):  # a tuple of untracked values stops being tracked at a collection that
        gc.collect()  # finds its values untracked (nested ones: within a few collections)
    blocks = list(rekeyer.engines["pod-a"].blocks.values())
    assert len(blocks) == n_blocks and not any(gc.is_tracked(b) for b in blocks)


@pytest.mark.parametrize("run", [True, False], ids=["one-event", "block-by-block"])
def test_blocks_share_their_tiers_and_a_chunks_blocks_its_placement(run: bool) -> None:
    """A block's tiers and the chunks holding it are tuples its neighbours share (an engine's
    blocks one tiers tuple per tier, a chunk's blocks one placement), not one of each per
    block: ≈80 B a block of the map, in events of a request and in events of one block."""
    rng = np.random.default_rng(1)
    rekeyer = Rekeyer(KeyScheme("blake3", 64), 10_000)
    hashes = [rng.bytes(32) for _ in range(8)]  # two chunks of four blocks
    ids = rng.integers(0, 150_000, 8 * 16).tolist()
    if run:
        events = [BlockStored(hashes, None, ids, 16, medium="GPU")]
    else:
        events = [BlockStored([h], hashes[i - 1] if i else None, ids[16 * i : 16 * (i + 1)], 16,
                              medium="GPU") for i, h in enumerate(hashes)]  # fmt: skip
    for event in events:
        rekeyer.translate("pod-a", "llama", batch(event))
    blocks = [rekeyer.engines["pod-a"].blocks[h] for h in hashes]
    assert len({id(tiers) for _, tiers, _ in blocks}) == 1
    held = [placed for _, _, placed in blocks]
    assert len({id(p) for p in held[:4]}) == 1 and len({id(p) for p in held[4:]}) == 1
    assert held[0] != held[4] and all(len(p) == 1 for p in held)

    # offloaded to the CPU, then evicted from the GPU: still one tiers tuple for all, and
    # one placements tuple a chunk at each step
    def shared() -> tuple[list[Any], list[Any]]:
        blocks = [rekeyer.engines["pod-a"].blocks[h] for h in hashes]
        return [t for _, t, _ in blocks], [p for _, _, p in blocks]

    rekeyer.translate("pod-a", "llama", batch(BlockStored(hashes, None, ids, 16, medium="CPU")))
    tiers, held = shared()
    assert len({id(t) for t in tiers}) == 1 and all(len(p) == 2 for p in held)
    assert len({id(p) for p in held[:4]}) == 1 and len({id(p) for p in held[4:]}) == 1
    rekeyer.translate("pod-a", "llama", batch(BlockRemoved(hashes, "GPU")))
    tiers, held = shared()
    assert tiers[0] == ("engine-cpu",) and len({id(t) for t in tiers}) == 1
    assert all(p[0][2] == "engine-cpu" for p in held)
    assert len({id(p) for p in held[:4]}) == 1 and len({id(p) for p in held[4:]}) == 1


def test_a_block_stored_again_keeps_its_place_in_the_map_and_becomes_the_newest() -> None:
    """A CPU offload stores every GPU block again: each becomes the newest (evicted last) in
    place, so the map does not grow by a deleted slot per block (which a pop and a new
    insert left: ≈140 B a block until the table was rebuilt)."""
    rng = np.random.default_rng(2)
    rekeyer = Rekeyer(KeyScheme("blake3", 64), 100_000)
    requests = [
        ([rng.bytes(32) for _ in range(64)], rng.integers(0, 150_000, 64 * 16).tolist())
        for _ in range(40)
    ]
    for hashes, ids in requests:
        rekeyer.translate("pod-a", "llama", batch(BlockStored(hashes, None, ids, 16, medium="GPU")))
    blocks = rekeyer.engines["pod-a"].blocks
    size, first = sys.getsizeof(blocks), list(blocks)
    for hashes, ids in requests[:20]:
        rekeyer.translate("pod-a", "llama", batch(BlockStored(hashes, None, ids, 16, medium="CPU")))
    assert sys.getsizeof(blocks) == size
    offloaded = [h for hashes, _ in requests[:20] for h in hashes]
    moved = set(offloaded)
    assert list(blocks) == [h for h in first if h not in moved] + offloaded


def test_engine_chunks_reach_the_directory_as_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31: no ``CacheEntry`` and no ``ObjectKey`` per chunk between an engine batch and
    the directory (stores, removals, evictions of a full map): entries are columns, one key
    shape checked per batch (and the directory interns a shape it never saw). The directory
    ends as the same batches applied as objects leave it."""
    made = {"entries": 0, "keys": 0}
    entry_init, key_init = CacheEntry.__post_init__, ObjectKey.__post_init__

    def counted(name: str, init: Any) -> Any:
        def wrapped(self: Any) -> None:
            made[name] += 1
            init(self)

        return wrapped

    rekeyer, directory = fed(chunk_size=16, max_blocks=4, blend=True)
    _, as_objects = fed(chunk_size=16, max_blocks=4, blend=True)
    more = BlockStored([b"\x07" * 32, b"\x08" * 32], None, [9] * 32, 16, medium="CPU")
    engine = [batch(TEXT, TEXT_MORE), batch(BlockRemoved([HASHES[2]], "GPU"), more)]
    for engine_batch in engine:
        monkeypatch.setattr(CacheEntry, "__post_init__", counted("entries", entry_init))
        monkeypatch.setattr(ObjectKey, "__post_init__", counted("keys", key_init))
        ops = rekeyer.translate("pod-a", "llama", engine_batch)
        directory.apply_columns([op for op in ops if isinstance(op, ColumnBatch)])
        monkeypatch.undo()
        n_ops = sum(isinstance(op, ColumnBatch) for op in ops)  # (+ 1: the shape interned)
        assert made["entries"] == 0 and made["keys"] <= n_ops + 1
        for op in ops:
            assert isinstance(op, ColumnBatch) and op.columns is not None
            as_objects.consume(op.batch())
        made.update(entries=0, keys=0)
    assert rekeyer.counts["evicted_blocks"] > 0 and rekeyer.counts["chunks_removed"] == 1
    listed, expected = directory.list_keys(limit=100), as_objects.list_keys(limit=100)
    assert listed == expected and len(listed.items) >= 2
    for mine, theirs in zip(listed.items, expected.items, strict=True):
        assert mine.content is not None and theirs.content is not None
        assert mine.content.tolist() == theirs.content.tolist()
    ns = BlendNamespace("llama", "", 1)
    query = np.array([0] * 5 + TOKENS[:32] + [9] * 16, np.uint32)
    matches = directory.blend_match(query, ns)
    assert matches == as_objects.blend_match(query, ns) and matches


def test_a_model_name_no_key_can_carry_is_refused_not_applied() -> None:
    """The subscriber checks a topic's model before translating; the columns check it again
    (as a decoded body's are) rather than hand the directory a key it would refuse."""
    rekeyer, _ = fed(chunk_size=16)
    with pytest.raises(ValueError, match="model name"):
        rekeyer.translate("pod-a", "", batch(TEXT))


def _two_block_chunk(j: int) -> BlockStored:
    """One 32-token chunk as two 16-token blocks, distinct per ``j``."""
    hashes: list[bytes | int] = [
        (100 + 2 * j).to_bytes(32, "big"),
        (101 + 2 * j).to_bytes(32, "big"),
    ]
    return BlockStored(hashes, None, list(range(1000 + 32 * j, 1032 + 32 * j)), 16, medium="GPU")


def test_a_chunk_whose_block_a_full_map_evicted_is_not_placed() -> None:
    """A full map (10 blocks, engine A's) while engine B stores a chunk of two blocks: the
    first block's eviction of B's own oldest could evict that chunk's first block before
    the chunk was complete, and the chunk was placed all the same — a copy the directory
    could not take back (B's removal of that block was an unknown block; the chunk stayed
    listed on B's GPU). Every placed chunk has all its blocks in the map, so removing any
    of them removes it."""
    rekeyer, directory = fed(chunk_size=32, max_blocks=10)
    for j in range(5):
        apply(rekeyer, directory, "eng-a", "llama", batch(_two_block_chunk(j)))
    for j in range(10, 13):
        apply(rekeyer, directory, "eng-b", "llama", batch(_two_block_chunk(j)))
    assert rekeyer.total_blocks == 10
    for j in range(10, 13):  # each of B's chunks: placed only with both its blocks mapped
        tokens = list(range(1000 + 32 * j, 1032 + 32 * j))
        first, second = _two_block_chunk(j).block_hashes
        mapped = first in rekeyer.engines["eng-b"].blocks, second in rekeyer.engines["eng-b"].blocks
        held = holders(directory, tokens) == {("eng-b", "gpu"): 1}
        assert held == all(mapped), (j, mapped, held)
        if held:  # removing its first block removes it
            apply(rekeyer, directory, "eng-b", "llama", batch(BlockRemoved([first], medium="GPU")))
            assert holders(directory, tokens) == {}
    roomy, listed = fed(chunk_size=32, max_blocks=100)  # the control: a map that evicts nothing
    for j in (*range(5), *range(10, 13)):
        apply(roomy, listed, "eng-a" if j < 5 else "eng-b", "llama", batch(_two_block_chunk(j)))
    for j in range(10, 13):  # each placed, and taken back by its first block's removal
        tokens = list(range(1000 + 32 * j, 1032 + 32 * j))
        assert holders(listed, tokens) == {("eng-b", "gpu"): 1}
        first = _two_block_chunk(j).block_hashes[0]
        apply(roomy, listed, "eng-b", "llama", batch(BlockRemoved([first], medium="GPU")))
        assert holders(listed, tokens) == {}


def test_a_block_size_change_inside_a_chunk_is_counted_and_skipped() -> None:
    """A 16-token block, then its child of 32 tokens, with chunks of 32: the chain made one
    chunk of 48 tokens (listed with ``num_tokens: 48``; a lookup of it a 413). The child is
    skipped and counted; a chain whose size changes at a chunk boundary is whole chunks."""
    rekeyer, directory = fed(chunk_size=32)
    first = BlockStored([b"\x01" * 32], None, list(range(72000, 72016)), 16, medium="GPU")
    child = BlockStored([b"\x02" * 32], b"\x01" * 32, list(range(72016, 72048)), 32, medium="GPU")
    apply(rekeyer, directory, "eng", "llama", batch(first, child))
    assert rekeyer.counts["block_size_changes"] == 1 and rekeyer.counts["chunks_stored"] == 0
    assert directory.stats().keys == 0
    second = BlockStored([b"\x03" * 32], b"\x01" * 32, list(range(72016, 72032)), 16, medium="GPU")
    bigger = BlockStored([b"\x04" * 32], b"\x03" * 32, list(range(72032, 72064)), 32, medium="GPU")
    apply(rekeyer, directory, "eng", "llama", batch(second, bigger))
    assert rekeyer.counts["block_size_changes"] == 1 and rekeyer.counts["chunks_stored"] == 2
    assert holders(directory, list(range(72000, 72064))) == {("eng", "gpu"): 2}


def test_a_run_continuing_a_partial_chunk_whose_block_went_is_not_placed() -> None:
    """The run path (new blocks of a plain chain in one event) placed the chunk it completed
    even when a block of the partial chunk it continued had been evicted (found in review):
    64-token chunks of 16-token blocks, a map of 4 blocks; b1, b2 stored, an unrelated chain
    evicts b1 and is removed, then [b3, b4] complete the chunk in one event."""
    rekeyer, directory = fed(chunk_size=64, max_blocks=4)
    ids = list(range(9000, 9064))
    b = [bytes([k]) * 32 for k in range(1, 5)]
    first = BlockStored(b[:2], None, ids[:32], 16, medium="GPU")
    apply(rekeyer, directory, "eng", "llama", batch(first))
    other = [bytes([k]) * 32 for k in range(10, 13)]
    apply(rekeyer, directory, "eng", "llama",
          batch(BlockStored(other, None, list(range(5000, 5048)), 16, medium="GPU")))  # fmt: skip
    assert b[0] not in rekeyer.engines["eng"].blocks  # b1 evicted, b2 kept
    apply(rekeyer, directory, "eng", "llama", batch(BlockRemoved(other, medium="GPU")))
    apply(rekeyer, directory, "eng", "llama",
          batch(BlockStored(b[2:], b[1], ids[32:], 16, medium="GPU")))  # fmt: skip
    assert holders(directory, ids) == {}  # not placed: its first block is not in the map
    roomy, listed = fed(chunk_size=64, max_blocks=8)  # the control: the same, nothing evicted
    apply(roomy, listed, "eng", "llama", batch(first))
    apply(
        roomy, listed, "eng", "llama", batch(BlockStored(b[2:], b[1], ids[32:], 16, medium="GPU"))
    )
    assert holders(listed, ids) == {("eng", "gpu"): 1}
