"""The processes the tests start read kvatlas's bytecode, not its sources (tests/conftest.py,
``write_bytecode``): where ``PYTHONDONTWRITEBYTECODE`` is set, nothing else writes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import kvatlas

ROOT = Path(kvatlas.__file__).parent


def _stale(source: Path) -> bool:
    """Whether ``source`` has no bytecode, or bytecode of another version of it (the header's
    source modification time and size, docs: PEP 552)."""
    try:
        header = Path(importlib.util.cache_from_source(str(source))).read_bytes()[:16]
    except FileNotFoundError:
        return True
    if header[:4] != importlib.util.MAGIC_NUMBER or int.from_bytes(header[4:8], "little") != 0:
        return True
    stat = source.stat()
    mtime, size = (int.from_bytes(header[i : i + 4], "little") for i in (8, 12))
    return (mtime, size) != (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF)


def test_every_kvatlas_module_has_bytecode_for_its_current_source() -> None:
    stale = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py")) if _stale(p)]
    assert stale == []
