"""The demos run and verify what they show (reuse happens, re-RoPE'd KV is exact)."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvatlas.cli import main
from kvatlas.demo.fleet import run_embedded


def test_embedded_fleet_demo_reuses_and_verifies() -> None:
    tally = run_embedded(seed=3, documents=6, queries=6, console=Console(quiet=True))
    assert tally.blend_tokens > 0 and tally.prefix_tokens > 0
    assert tally.max_error < 1e-3
    assert tally.misses == 0
    assert {"blend local_l1", "blend peer_l1"} & set(tally.sources)


@pytest.mark.parametrize(
    "argv", [["demo", "--documents", "4", "--queries", "3"], ["demo", "--keys"]]
)
def test_cli_demo_exit_code(argv: list[str]) -> None:
    assert main(argv) == 0
