"""``kvatlas bench eviction`` end to end on a small slice of the Mooncake trace (--quick):
every policy's row, hit ratios no higher than the no-quota ceiling, bytes evicted under the
quota, and a bad configuration refused (docs/cache-control.md, "Fleet eviction")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvatlas.cli import main

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
