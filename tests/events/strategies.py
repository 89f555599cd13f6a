"""Hypothesis strategies for event batches (shared by the events and directory tests)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank

names = st.text(st.characters(codec="utf-8", exclude_characters="@/\\\x00"), max_size=12)


@st.composite
def object_keys(draw: st.DrawFn) -> ObjectKey:
    ws = draw(st.integers(1, 4))
    rank = draw(st.integers(0, ws - 1))
    return ObjectKey(
        draw(st.binary(min_size=32, max_size=32)),
        draw(names.filter(bool)),
        pack_kv_rank(ws, rank, ws, rank),
        draw(st.integers(0, (1 << 64) - 1)),
        draw(names),
    )


contents = st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=16).map(
    lambda xs: np.array(xs, dtype=np.uint32)
)


@st.composite
def entries(draw: st.DrawFn, shared_content: np.ndarray | None = None) -> CacheEntry:
    tokens = draw(st.none() | contents | st.just(shared_content))
    return CacheEntry(
        draw(object_keys()),
        draw(st.integers(0, (1 << 63) - 1)),
        tokens,
        draw(st.integers(-1, 1 << 40)),
    )


@st.composite
def batches(draw: st.DrawFn) -> EventBatch:
    kind = draw(st.sampled_from(["store", "delete", "access", "config"]))
    common = dict(
        instance_id=draw(names.filter(bool)),
        incarnation=draw(st.integers(0, (1 << 64) - 1)),
        seq=draw(st.integers(1, (1 << 64) - 1)),
        event_type=kind,
        tier=draw(st.sampled_from(["l1", "l2"])),
        backend=draw(names.filter(bool)),
        shared=draw(st.booleans()),
        ts=draw(st.floats(allow_nan=False, allow_infinity=False)),
    )
    if kind == "config":
        return EventBatch(
            **common,  # type: ignore[arg-type]
            capacity_bytes=draw(st.integers(0, (1 << 63) - 1)),
            capacity_revision=draw(st.integers(0, (1 << 63) - 1)),
        )
    shared_content = draw(contents)
    es = draw(st.lists(entries(shared_content), max_size=6))
    return EventBatch(**common, entries=tuple(es))  # type: ignore[arg-type]
