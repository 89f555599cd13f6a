"""What the directory reports about itself, as values taken under its lock: the ingest counts
of one ``POST /events``, the counters of ``GET /directory/stats`` and the used bytes per module
beside declared capacities (``GET /instances/usage``). See :mod:`kvatlas.directory.key_directory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvatlas.directory.blend import BlendStats


@dataclass(frozen=True, slots=True)
class IngestCounts:
    """The ``POST /events`` reply."""

    applied: int = 0
    duplicates: int = 0
    stale: int = 0


@dataclass(frozen=True, slots=True)
class DirectoryStats:
    """The directory's counters, taken together under its lock (``blend`` right after, under
    the index's lock). The coordinator maps them to ``GET /directory/stats``."""

    chunk_size: int
    keys: int
    chunks: int
    bound_chunks: int  # chunks with known content
    placements: int
    l1_placements_by_instance: dict[str, int]  # own L1 copies (what fencing drops)
    bytes_by_tier: dict[str, int]
    placements_by_tier: dict[str, int]
    batches: dict[str, int]  # Outcome value -> batches
    emitters: int
    gaps: int
    capacity_bytes_by_instance: dict[str, int]
    blend: BlendStats | None  # the blend index's stats; None while blend lookup is off
    content_conflicts: int = 0  # stores of other ids refused a binding other tenants hold


@dataclass(frozen=True, slots=True)
class ModuleUsage:
    """Copies in one module: an instance's own (tier, backend), or a shared pool
    (``instance_id`` ``None``), with the capacity declared for it (0: none declared)."""

    instance_id: str | None
    tier: str
    backend: str
    placements: int
    used_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class DirectoryUsage:
    """Every non-empty or declared module, and which instances declared capacity."""

    modules: list[ModuleUsage]
    declared: frozenset[str]
