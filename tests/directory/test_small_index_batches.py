"""A vouched index batch of at most ``SMALL_BATCH`` writes (what a node's small store or delete
batch queues) is applied op by op with scalars instead of as columns: the same directory
after every batch, by everything a client reads back and what the index holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory
from kvatlas.directory.blend import index as index_module
from kvatlas.directory.blend import op_columns as op_module
from kvatlas.events import CacheEntry, EventBatch, decode_json_columns, encode_json
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.directory.helpers import occupant_hashes
from tests.directory.test_columnar_ingest import CHUNK, _state, batch_st


def _held(d: KeyDirectory) -> Any:
    """What the index holds and counts: its contents (by value) and hashes by id, each live
    namespace's claims."""
    index = d.blend_index
    assert index is not None
    state = index._state
    contents = [t if t is None or type(t) is bytes else t.tobytes() for t in state.tokens]
    counts = (state.contents, state.occupants, state.claims, state.n_extra)
    spaces = state.namespaces  # (the ids are internal: a namespace's may differ between paths)
    claims = {namespace: spaces.claims[ns] for namespace, ns in spaces._ids.items()}
    return contents, occupant_hashes(state), claims, counts


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_small_batches_as_single_ops_equal_the_columns(data: st.DataObject) -> None:
    columns = KeyDirectory(CHUNK, enable_blend_lookup=True)
    scalars = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for _ in range(data.draw(st.integers(1, 8))):
        batches = decode_json_columns(encode_json(data.draw(st.lists(batch_st(), max_size=3))))
        fence = data.draw(st.sampled_from([None, None, None, "a", "b"]))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(op_module, "SMALL_BATCH", 0)  # every batch as columns
            columns.apply_columns(batches)
            if fence is not None:
                columns.fence_instance(fence)
        scalars.apply_columns(batches)
        if fence is not None:
            scalars.fence_instance(fence)
        assert _state(scalars) == _state(columns)
        assert _held(scalars) == _held(columns)


def test_a_small_batch_is_taken_as_single_ops_and_a_larger_one_as_columns() -> None:
    """The test above compares the two paths only if the small one is taken."""
    taken: list[int] = []
    singles = index_module.vouched_singles

    def counted(op: Any) -> Any:
        out = singles(op)
        taken.append(-1 if out is None else len(out))
        return out

    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(index_module, "vouched_singles", counted)
        for seq, n in enumerate((1, op_module.SMALL_BATCH, op_module.SMALL_BATCH + 1), start=1):
            entries = tuple(
                CacheEntry(ObjectKey(bytes([seq, i]) * 16, "m", pack_kv_rank(1, 0, 1, 0)), 1,
                           np.arange(CHUNK, dtype=np.uint32) + 100 * seq + i, CHUNK)
                for i in range(n)
            )  # fmt: skip
            d.consume(EventBatch("a", 1, seq, "store", "l1", "dram", entries=entries))
    assert taken == [1, op_module.SMALL_BATCH, -1]
