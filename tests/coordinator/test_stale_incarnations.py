"""Batches refused as stale — an incarnation older than the one the directory follows for
their instance — while they are live (sent within the last minute, by their ``ts``): two
processes emit under one instance id (two nodes given one ``--instance-id``: the newer one's
start fenced the other, whose batches are then all stale), or a node restarted with its clock
stepped back (its incarnation is its start time). Either way the directory is wrong until an
operator acts, and it was visible only as a metric label: the coordinator logs a WARNING
naming the instance, both incarnations and the causes, at the first stale batch of a run and
at every power of two after; batches of an old incarnation read from history (their ``ts`` an
hour old, a replica catching up) are not logged."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank

C = 16
RANK = pack_kv_rank(1, 0, 1, 0)


def batch(incarnation: int, seq: int, ts: float, i: int) -> EventBatch:
    tokens = np.arange(C, dtype=np.uint32) + 1000 * i
    key = ObjectKey(chunk_hashes(tokens, C)[0], "m", RANK)
    entry = CacheEntry(key, 64, tokens, 0)
    return EventBatch("n1", incarnation, seq, "store", "l1", "dram", False, ts, (entry,))


def test_live_stale_batches_are_logged_history_is_not(caplog: pytest.LogCaptureFixture) -> None:
    service = CoordinatorService(CoordinatorConfig(chunk_size=C))
    now_ns = time.time_ns()
    newer, older = now_ns, now_ns - 120 * 10**9
    assert service.ingest([batch(newer, 1, time.time(), 0)]).applied == 1
    with caplog.at_level(logging.WARNING, logger="kvatlas.coordinator.ingestion"):
        for seq in range(1, 6):  # five live batches of the older incarnation
            assert service.ingest([batch(older, seq, time.time(), seq)]).stale == 1
        assert service.ingest([batch(older, 9, time.time() - 3600, 9)]).stale == 1  # history
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # the 1st, 2nd and 4th of the run
    assert all("n1" in w and str(older) in w and str(newer) in w for w in warnings), warnings
    assert "--instance-id" in warnings[0] and "clock" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvatlas.coordinator.ingestion"):
        assert service.ingest([batch(newer, 2, time.time(), 20)]).applied == 1  # run over
        assert service.ingest([batch(older, 10, time.time(), 21)]).stale == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
