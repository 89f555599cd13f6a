"""The prefix lookup's token ids written by the compiled writer against the one definition of
the wire shape (``wire.lookup_to_wire`` with its lists, encoded by the service's JSON
encoder): byte for byte, for every id in [0, 2^32)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator import warm_up
from kvatlas.coordinator._lookup_reply import _write_lists, json_id_lists
from kvatlas.coordinator.query import KeysQuery, decode_lookup_body, lookup_query
from kvatlas.coordinator.warm_up import warm_up_lookup_kernels
from kvatlas.coordinator.wire import key_to_wire, lookup_to_wire
from kvatlas.directory import KeyDirectory
from kvatlas.directory.prefixes import prefix_summary
from kvatlas.directory.records import TokenLookup
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.routing import JSON
from tests.coordinator.helpers import (
    CS,
    fresh,
    hashes,
    lookup_tokens,
    post_batches,
    running,
    wire_batch,
    wire_entry,
    wire_key,
)
from tests.directory.test_gil_holding import _gil_waiter

U32 = (1 << 32) - 1
EDGES = sorted({0, U32} | {v for k in range(1, 10) for v in (10**k - 1, 10**k, 10**k + 1)})


def _lists(contents: list[np.ndarray | None]) -> list[bytes]:
    return [msgspec.json.encode([] if c is None else c.tolist()) for c in contents]


def test_every_digit_count_and_both_ends_of_the_range() -> None:
    """Each id next to a power of ten (where the digit count and the division by 100 turn),
    0 and 2^32 - 1, then a million at random: as ``msgspec`` writes them."""
    edges = np.array(EDGES, np.uint32)
    rng = np.random.default_rng(7)
    spread = rng.integers(0, U32, 1_000_000, endpoint=True, dtype=np.uint64).astype(np.uint32)
    contents = [edges, spread]
    raws = json_id_lists(contents)
    assert raws is not None
    assert [bytes(r) for r in raws] == _lists(contents)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, U32), max_size=40).map(lambda v: np.array(v, np.uint32)),
            st.lists(st.integers(0, 0xFFFF), max_size=40).map(lambda v: np.array(v, np.uint16)),
            st.lists(st.sampled_from(EDGES), max_size=40).map(lambda v: np.array(v, np.uint32)),
        ),
        max_size=12,
    )
)
def test_contents_are_written_as_their_lists(contents: list[np.ndarray | None]) -> None:
    """Unknown contents, empty ones, ``uint16`` and ``uint32`` ids, in any mix."""
    raws = json_id_lists(contents)
    assert raws is not None
    assert [bytes(r) for r in raws] == _lists(contents)


@pytest.mark.parametrize(
    "content",
    [
        np.array([1, 2], np.int64),
        np.array([1, 2], np.uint64),
        np.array([[1, 2]], np.uint32),
        [1, 2],
    ],
)
def test_what_is_not_unsigned_ids_of_32_bits_is_left_to_the_lists(content: object) -> None:
    assert json_id_lists([np.array([1], np.uint32), content]) is None  # type: ignore[list-item]


def _directory_lookup() -> TokenLookup:
    """A directory's lookup of chunks with ids above 2^16, one without tokens, two absent."""
    directory = KeyDirectory(4, enable_blend_lookup=True)
    keys = [ObjectKey(bytes([i]) * 32, "m", pack_kv_rank(1, 0, 1, 0)) for i in range(6)]
    rng = np.random.default_rng(3)
    entries = []
    for i, key in enumerate(keys[:4]):
        ids = None if i == 2 else rng.integers(0, 1 << 20, 4).astype(np.uint32)
        entries.append(CacheEntry(key, 64, ids, -1 if ids is None else 4 * i))
    directory.consume(EventBatch("node-1", 1, 1, "store", "l1", "dram", entries=tuple(entries)))
    results = directory.lookup(keys)
    return TokenLookup(len(keys), results, prefix_summary(results))


def test_a_lookup_reply_is_the_encoded_wire_shape() -> None:
    found = _directory_lookup()
    contents = [kp.content for kp in found.results]
    assert any(c is None for c in contents) and any(c is not None for c in contents)
    ids = json_id_lists(contents)
    assert ids is not None
    assert JSON.encode(lookup_to_wire(found, ids)) == JSON.encode(lookup_to_wire(found))


def test_the_lookup_route_answers_the_stored_ids() -> None:
    """Over HTTP, ids above 2^16 stored by a node come back as its client decodes them."""
    tokens = [(1 << 31) + 7 * i for i in range(2 * CS)]
    with running() as (_, client):
        entries = [
            wire_entry(wire_key(h), tokens=tokens[i * CS : (i + 1) * CS], offset=i * CS)
            for i, h in enumerate(hashes(tokens))
        ]
        post_batches(client, wire_batch(fresh("node"), 1, 1, entries=entries)).raise_for_status()
        reply = lookup_tokens(client, tokens)
    assert [r["token_ids"] for r in reply["results"]] == [tokens[:CS], tokens[CS:]]


def test_a_long_prompts_lookup_never_releases_the_gil() -> None:
    """The lookup pool's work for a 32k-token prompt (128 keys, Llama 3 ids): from the body's
    bytes to the reply's. Two releases a lookup (numpy's compare sizing the body, a 2-D
    broadcast gathering the rows) made each wait for the GIL behind the other threads."""
    chunk = 256
    rng = np.random.default_rng(5)
    directory = KeyDirectory(chunk, enable_blend_lookup=True)
    rank = pack_kv_rank(1, 0, 1, 0)
    prompts = []
    for p in range(8):
        entries = tuple(
            CacheEntry(
                ObjectKey(rng.bytes(32), "m", rank),
                64,
                rng.integers(0, 128_256, chunk).astype(np.uint32),
                i * chunk,
            )
            for i in range(128)
        )
        directory.consume(EventBatch("node-1", 1, p + 1, "store", "l1", "dram", entries=entries))
        keys = [key_to_wire(e.key) for e in entries]
        prompts.append(msgspec.json.encode({"keys": keys}))

    def answer(raw: bytes) -> bytes:
        query = lookup_query(decode_lookup_body(raw, 1 << 20, 1 << 16), 1 << 20, 1 << 16)
        assert isinstance(query, KeysQuery)
        results = directory.lookup(query.keys)
        found = TokenLookup(len(query.keys), results, prefix_summary(results))
        return JSON.encode(lookup_to_wire(found, json_id_lists([r.content for r in results])))

    answer(prompts[0])  # warm
    with _gil_waiter() as woken:
        for _ in range(5):
            replies = [answer(raw) for raw in prompts]
    assert all(len(msgspec.json.decode(r)["results"]) == 128 for r in replies)
    assert woken[0] < 10  # two releases a lookup: ≈80


def test_the_services_warm_up_compiles_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else a coordinator's first prefix lookup compiles it (seconds without numba's cache):
    the warm-up writes a lookup's ids (and so compiles :func:`_write_lists` in its process)."""
    written: list[object] = []
    monkeypatch.setattr(warm_up, "json_id_lists", lambda c: written.append(json_id_lists(c)))
    warm_up_lookup_kernels()
    assert written and written[0] is not None and _write_lists.signatures
