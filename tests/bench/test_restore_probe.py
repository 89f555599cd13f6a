"""``bench directory``'s restore rows: each restore in a process of its own, as a
coordinator's start (fresh memory), timed there and reported back."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.bench.restore_probe import restore_in_fresh_process
from kvatlas.directory import KeyDirectory, save_snapshot
from tests.directory.helpers import CS, Emitter, entry, key, toks


def test_a_restore_is_timed_in_a_process_of_its_own(tmp_path: Path) -> None:
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 30)]))
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    for blend in (False, True):
        seconds, cpu, keys, first = restore_in_fresh_process(path, CS, blend)
        assert seconds > 0 and cpu > 0 and keys == 29
        assert (first is not None and first > 0) if blend else first is None
    with pytest.raises(RuntimeError, match="restore probe failed"):
        restore_in_fresh_process(path, CS * 2, True)  # (a chunk-size mismatch: refused)
