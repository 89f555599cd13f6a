"""Re-keying against an oracle: an engine that shares prefixes between requests at block
granularity (stores only its new blocks, parent = the last shared block, in events of any
split) must leave exactly the kvatlas keys of every full chunk of every request's tokens, for
any chunk size that is a multiple of the block size, each bound to exactly its tokens; removing
a block removes exactly the full chunks that hold it."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.events.vllm_wire import BlockRemoved, BlockStored, KVEventBatch
from kvatlas.keys import chunk_hashes
from tests.kv_events.helpers import apply, fed

B = 4


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    return hashlib.sha256((parent or b"") + np.asarray(tokens, ">u4").tobytes()).digest()


requests = st.lists(
    st.tuples(st.integers(0, 50), st.integers(0, 6), st.integers(1, 8), st.integers(1, 3)),
    min_size=1, max_size=12,
)  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(requests, st.sampled_from([4, 8, 16]), st.integers(0, 2**32 - 1), st.booleans())
def test_keys_equal_the_full_chunks_of_every_request(
    reqs: list[tuple[int, int, int, int]], chunk: int, seed: int, remove: bool
) -> None:
    rng = np.random.default_rng(seed)
    rekeyer, directory = fed(chunk_size=chunk)
    seqs: list[list[int]] = []  # each request's tokens
    chains: list[list[bytes]] = []  # each request's block hashes
    for pick, shared, new, splits in reqs:
        base_tokens, base_hashes = ([], []) if not seqs else (seqs[pick % len(seqs)],
                                                              chains[pick % len(seqs)])  # fmt: skip
        k = min(shared, len(base_hashes))
        tokens, hashes = list(base_tokens[: k * B]), list(base_hashes[:k])
        events = []
        part_sizes = np.array_split(np.arange(new), min(splits, new))
        for part in part_sizes:
            parent = hashes[-1] if hashes else None
            new_tokens, new_hashes = [], []
            for _ in part:
                # tiny alphabet: many equal blocks; ids above 2^16 that a wrong byte order
                # would read as other ids (70,000 = 0x00011170; 0x01012171; 0x02023172)
                t = (rng.integers(0, 3, B) * 0x1000001 + 70_000).tolist()
                h = block_hash(hashes[-1] if hashes else None, t)
                tokens += t
                hashes.append(h)
                new_tokens += t
                new_hashes.append(h)
            events.append(BlockStored(new_hashes, parent, new_tokens, B, medium="GPU"))
        apply(rekeyer, directory, "pod-a", "m", KVEventBatch(1.0, events))
        seqs.append(tokens)
        chains.append(hashes)

    def oracle(seqs: list[list[int]]) -> dict[bytes, list[int]]:
        return {
            h: s[i * chunk : (i + 1) * chunk]
            for s in seqs
            for i, h in enumerate(chunk_hashes(np.asarray(s, np.uint32), chunk))
        }

    def placed() -> dict[bytes, list[int]]:
        items = directory.list_keys(limit=100_000).items
        assert all(item.content is not None for item in items)
        return {item.key.chunk_hash: item.content.tolist() for item in items}  # type: ignore[union-attr]

    assert placed() == oracle(seqs)
    if remove:
        owner = chains[int(rng.integers(0, len(chains)))]
        last = owner[int(rng.integers(0, len(owner)))]
        apply(rekeyer, directory, "pod-a", "m", KVEventBatch(2.0, [BlockRemoved([last], "GPU")]))
        gone = set()  # every full chunk, of any request, that holds the removed block
        for tokens, hashes in zip(seqs, chains, strict=True):
            full = chunk_hashes(np.asarray(tokens, np.uint32), chunk)
            for i, h in enumerate(hashes):
                if h == last and i * B // chunk < len(full):
                    gone.add(full[i * B // chunk])
        assert placed() == {h: t for h, t in oracle(seqs).items() if h not in gone}
