"""The coordinator process's interpreter settings (``coordinator/runtime.py``): after starting
from a snapshot, what is alive is frozen out of the cyclic collector's sight (and again each
time the directory doubles), and the longest collection pause per generation is on
``/metrics``."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from kvatlas.coordinator import runtime
from kvatlas.coordinator.server import free_port
from kvatlas.directory import KeyDirectory, save_snapshot
from kvatlas.processes import spawn_service, stop
from tests.directory.helpers import CS, Emitter, entry, key, toks


def _metric(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name``."""
    pattern = rf"^{name}(\{{[^}}]*\}})? (\S+)$"
    return {m.group(1) or "": float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def test_a_coordinator_restored_from_a_snapshot_has_frozen_its_long_lived_state(
    tmp_path: Path,
) -> None:
    d, em = KeyDirectory(CS), Emitter("a")
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 30)]))
    snapshot = tmp_path / "c.snap"
    save_snapshot(d, snapshot, stream_position=None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(CS),
            "--snapshot-path", str(snapshot), "--snapshot-interval", "3600"]  # fmt: skip
    proc = spawn_service(argv, url)
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        stop([proc])
    assert _metric(text, "kvatlas_directory_keys") == {"": 29.0}  # restored
    assert _metric(text, "kvatlas_gc_frozen_objects")[""] > 10_000  # modules, kernels, app
    pauses = _metric(text, "kvatlas_gc_longest_pause_seconds")
    assert set(pauses) == {'{generation="0"}', '{generation="1"}', '{generation="2"}'}
    assert all(seconds >= 0 for seconds in pauses.values())  # since start-up
    collections = _metric(text, "kvatlas_gc_collections_total")
    assert collections['{generation="2"}'] >= 1
    assert _metric(text, "kvatlas_gc_freezes_total") == {"": 1.0}  # once, at start-up


def test_the_long_lived_state_is_frozen_again_each_time_the_directory_doubles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    froze: list[int] = []
    growth = runtime.GrowthFreeze(30, minimum=100)  # as if frozen at 50 keys
    monkeypatch.setattr(runtime, "freeze_long_lived", lambda: froze.append(1))
    after = [growth.after_snapshot(keys) for keys in (60, 99, 100, 150, 199, 250, 400, 10)]
    assert after == [False, False, True, False, False, True, False, False]
    assert len(froze) == 2 and growth.frozen_at == 250
