"""``kvatlas bench eviction`` end to end on a small slice of the Mooncake trace (--quick):
every policy's row, hit ratios no higher than the no-quota ceiling, bytes evicted under the
quota, and a bad configuration refused (docs/cache-control.md, "Fleet eviction")."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvatlas.bench.eviction import Outcome, Planner, load_trace, simulate, winner
from kvatlas.cli import main
from kvatlas.coordinator.cache_control.eviction import EvictionConfig

TRACE = Path(__file__).parent / "data" / "mooncake-synthetic-head200.jsonl"


def test_quick_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eviction.json"
    assert main(["bench", "eviction", "--trace", str(TRACE), "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 200
    rows = {o["policy"]: o for o in report["outcomes"]}
    assert {"lru", "value"} <= set(rows)
    ceiling = report["ceiling"]
    assert ceiling["bytes_evicted"] == 0 and ceiling["token_hit_ratio"] > 0
    for row in rows.values():
        assert row["quota"] == 0.5
        assert 0 < row["token_hit_ratio"] <= ceiling["token_hit_ratio"]
        assert 0 < row["chunk_hit_ratio"] <= ceiling["chunk_hit_ratio"]
        assert row["bytes_evicted"] == row["keys_evicted"] * report["block_bytes"] > 0
        assert row["prefill_tokens_saved"] <= ceiling["prefill_tokens_saved"]
    assert report["winner"] in ("lru", "value")
    assert report["load_average"] and report["cores"]
    assert "winner" in capsys.readouterr().out


def test_a_bad_configuration_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "eviction", "--trace", str(TRACE), "--quotas", "1.5"]) == 2
    assert "refused" in capsys.readouterr().err


def test_a_request_reuses_its_leading_held_blocks_only(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 1600, "output_length": 1, "hash_ids": [1, 2, 5, 6]},
        {"timestamp": 20, "input_length": 1536, "output_length": 1, "hash_ids": [9, 2, 3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = load_trace(path, salts=1, limit=None)
    assert trace.slots_per_salt == (5,)  # 1, 2, 3, 5, 9: block 6 is cut short, never stored
    keep_all: Planner = lambda state, now_s: np.zeros(0, dtype=np.int64)  # noqa: E731
    outcome = simulate(trace, 2.0, keep_all, EvictionConfig(), 512, "keep all")
    assert outcome.prefill_tokens_saved == 2 * 512  # [1, 2] again; [9, 2, 3] misses at 9
    assert outcome.chunk_hit_ratio == 2 / 9
    assert outcome.token_hit_ratio == 1024 / (1536 + 1600 + 1536)


def test_requests_with_nothing_after_the_shared_prefix_spread_over_the_salts(
    tmp_path: Path,
) -> None:
    """A request whose blocks are all the prefix every request shares has no tenant block:
    its salt comes from its index in the trace, like the others' from their first own block
    (they all went to salt 0: three times the requests of any other salt)."""
    shared = [1, 2]
    lines = [
        {"timestamp": t, "input_length": 1024 + 512 * (t % 2), "output_length": 1,
         "hash_ids": shared + ([100 + t] if t % 2 else [])}
        for t in range(400)
    ]  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = load_trace(path, salts=4, limit=None)
    prefix_only = Counter(r.salt for r, line in zip(trace.requests, lines, strict=True)
                          if len(line["hash_ids"]) == len(shared))  # fmt: skip
    own = Counter(r.salt for r, line in zip(trace.requests, lines, strict=True)
                  if len(line["hash_ids"]) > len(shared))  # fmt: skip
    assert sum(prefix_only.values()) == sum(own.values()) == 200
    for counts in (prefix_only, own):  # 50 a salt, give or take what a hash spreads
        assert set(counts) == {0, 1, 2, 3} and max(counts.values()) < 2 * min(counts.values())
    again = load_trace(path, salts=4, limit=None)  # deterministic
    assert [r.salt for r in again.requests] == [r.salt for r in trace.requests]


def test_the_winner_saves_more_prefill_tokens_over_the_quotas() -> None:
    def row(policy: str, quota: float, saved: int) -> Outcome:
        return Outcome(policy, quota, 0.0, 0.0, saved, 0, 0, 0.0, 0.0, 0.0)

    rows = [row("lru", 0.25, 100), row("value", 0.25, 60), row("lru", 0.5, 100),
            row("value", 0.5, 110), row("lru", 0.75, 100), row("value", 0.75, 120)]  # fmt: skip
    assert winner(rows) == "lru"  # value wins at two quotas, saves less in all
    assert winner([row("lru", 0.5, 1), row("value", 0.5, 1)]) == "lru"  # a tie: LMCache's
    assert winner([row("lru", 0.5, 1), row("value", 0.5, 2)]) == "value"
