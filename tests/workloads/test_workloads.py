"""Workloads: Mooncake traces become prompts whose shared hash ids are shared tokens, the
``rag:`` generator reuses documents at varying offsets, and both are deterministic."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvatlas.errors import InvalidInput
from kvatlas.workloads import (
    BLOCK_SPAN,
    VOCAB_SIZE,
    RagSpec,
    block_tokens,
    generate_rag,
    open_workload,
    parse_rag,
    read_mooncake,
)
from kvatlas.workloads.tokens import MOONCAKE, RAG_DOCS, splitmix64


def test_splitmix64_is_vignas() -> None:
    # the first outputs of SplitMix64 seeded with 0 (Vigna's reference splitmix64.c)
    out = splitmix64(np.array([0, 0x9E3779B97F4A7C15], dtype=np.uint64))
    assert [int(v) for v in out] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_block_tokens_are_deterministic_and_distinct() -> None:
    a = block_tokens(MOONCAKE, 7)
    assert a.shape == (BLOCK_SPAN,) and np.array_equal(a, block_tokens(MOONCAKE, 7))
    assert np.array_equal(block_tokens(MOONCAKE, 7, 100), a[:100])  # a cut block is a prefix
    assert not np.array_equal(a, block_tokens(MOONCAKE, 8))
    assert not np.array_equal(a, block_tokens(RAG_DOCS, 7))
    assert a.min() >= 0 and a.max() < VOCAB_SIZE and a.max() > 65_535  # ids beyond 16 bits
    with pytest.raises(ValueError):
        block_tokens(MOONCAKE, 1, BLOCK_SPAN + 1)


def write_trace(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_mooncake_shared_hash_ids_are_shared_prefixes(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 40, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 5]},
        {"timestamp": 40, "input_length": 10, "output_length": 1, "hash_ids": [9]},
    ])  # fmt: skip
    a, b, c = read_mooncake(trace)
    assert (a.arrival_s, b.arrival_s, a.output_tokens, b.output_tokens) == (0.0, 0.04, 5, 7)
    assert (a.input_tokens, b.input_tokens, c.input_tokens) == (1300, 1536, 10)
    assert np.array_equal(a.prompt[:1024], b.prompt[:1024])  # hash ids 0, 1 at equal positions
    assert not np.array_equal(a.prompt[1024:1300], b.prompt[1024:1300])
    assert np.array_equal(a.prompt[1024:], block_tokens(MOONCAKE, 2, 276))  # the last block cut
    assert a.segments == (
        ("mooncake:0", 0, 512),
        ("mooncake:1", 512, 512),
        ("mooncake:2", 1024, 276),
    )
    assert [r.index for r in read_mooncake(trace, limit=2)] == [0, 1]


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        {"input_length": 10, "output_length": 1, "hash_ids": [0]},  # no timestamp
        {"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []},
        {"timestamp": 0, "input_length": 10, "output_length": True, "hash_ids": [0]},
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]},  # too few
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]},  # too many
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]},
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "0"},
    ],
)
def test_mooncake_refuses_a_broken_line_naming_it(tmp_path: Path, line: Any) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    trace = write_trace(tmp_path / "t.jsonl", [good, line])
    with pytest.raises(InvalidInput, match=r"t\.jsonl:2"):
        list(read_mooncake(trace))


def test_mooncake_refuses_time_going_back(tmp_path: Path) -> None:
    line = {"input_length": 10, "output_length": 1, "hash_ids": [0]}
    trace = write_trace(tmp_path / "t.jsonl", [{**line, "timestamp": 5}, {**line, "timestamp": 4}])
    with pytest.raises(InvalidInput, match="timestamp"):
        list(read_mooncake(trace))


def test_rag_spec_is_parsed_strictly() -> None:
    spec = parse_rag("rag:docs=200,k=5,zipf=1.2,rate=8,seed=3")
    assert spec == RagSpec(docs=200, k=5, zipf=1.2, rate=8.0, seed=3)
    assert parse_rag("rag:") == RagSpec()
    for bad in ["rag:docs=10,k=11", "rag:doc=10", "rag:docs=ten", "rag:k=2,k=3", "rag:zipf",
                "rag:rate=0", "rag:docs=5.5", "docs=10", "rag:question=0"]:  # fmt: skip
        with pytest.raises(InvalidInput):
            parse_rag(bad)


def test_rag_reuses_documents_at_varying_offsets() -> None:
    spec = parse_rag("rag:docs=40,k=4,zipf=1.0,rate=5,seed=1")
    requests = list(generate_rag(spec, 300))
    system = requests[0].prompt[: spec.system]
    seen: dict[str, np.ndarray] = {}
    offsets: dict[str, set[int]] = {}
    for r in requests:
        assert np.array_equal(r.prompt[: spec.system], system)  # the shared system prompt
        docs = [s for s in r.segments if s[0].startswith("rag:doc:")]
        assert len({d[0] for d in docs}) == spec.k  # k distinct documents
        assert sum(s[2] for s in r.segments) == r.input_tokens
        for name, offset, length in docs:
            piece = r.prompt[offset : offset + length]
            assert np.array_equal(seen.setdefault(name, piece), piece)  # the same tokens
            offsets.setdefault(name, set()).add(offset)
    assert max(len(o) for o in offsets.values()) > 5  # popular documents move around
    questions = {r.prompt[-spec.question :].tobytes() for r in requests}
    assert len(questions) == len(requests)  # every question its own
    popularity = Counter(d for r in requests for d, _, _ in r.segments if d.startswith("rag:doc:"))
    assert popularity["rag:doc:0"] > 3 * popularity.get("rag:doc:39", 0)  # Zipf
    gaps = np.diff([0.0] + [r.arrival_s for r in requests])
    assert (gaps > 0).all() and abs(gaps.mean() - 1 / spec.rate) < 0.2 / spec.rate  # Poisson


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    one = list(open_workload("rag:docs=30,k=3,seed=7", 20))
    two = list(open_workload("rag:docs=30,k=3,seed=7", 20))
    other = list(open_workload("rag:docs=30,k=3,seed=8", 20))
    assert all(np.array_equal(a.prompt, b.prompt) and a.arrival_s == b.arrival_s
               and a.segments == b.segments for a, b in zip(one, two, strict=True))  # fmt: skip
    assert not np.array_equal(one[0].prompt, other[0].prompt)


def test_open_workload_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="count"):
        open_workload("rag:docs=3,k=1")
    with pytest.raises(InvalidInput, match="no trace file"):
        open_workload(str(tmp_path / "missing.jsonl"))
