"""What a coordinator (or router replica) says when it cannot claim its port or snapshot path
(:func:`kvatlas.coordinator.server.claim_or_exit`): "is another … running?" only when another
process holds it (the port in use, the lock held); any other error names the path and what is
wrong with it (a ``--snapshot-path`` under a regular file said "File exists; is another
coordinator running?", naming no path)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import claim_or_exit, claim_state, lock_snapshot_path


def refusal(caplog: pytest.LogCaptureFixture, claim: object) -> str:
    caplog.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stopped:
        claim_or_exit(claim, "coordinator")  # type: ignore[arg-type]
    assert stopped.value.code == 1
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    return record.getMessage()


def test_only_a_held_claim_asks_whether_another_one_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    under_a_file = CoordinatorConfig(chunk_size=16, snapshot_path=tmp_path / "file" / "snap")
    said = refusal(caplog, lambda: claim_state(under_a_file))
    assert "is another" not in said, said
    assert str(tmp_path / "file") in said and "not starting" in said, said

    held = lock_snapshot_path(tmp_path / "snap")
    try:
        config = CoordinatorConfig(chunk_size=16, snapshot_path=tmp_path / "snap")
        said = refusal(caplog, lambda: claim_state(config))
        assert "in use by another coordinator" in said and "is another coordinator running?" in said
    finally:
        held.close()

    def port_taken() -> None:
        raise OSError(98, "Address already in use")

    assert "is another coordinator running?" in refusal(caplog, port_taken)
