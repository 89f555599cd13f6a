"""What the directory reports about itself, as values taken under its lock: the ingest counts
of one ``POST /events``, the counters of ``GET /directory/stats`` and the used bytes per module
beside declared capacities (``GET /instances/usage``). See :mod:`kvatlas.directory.key_directory`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kvatlas.directory.blend import BlendStats

Module = tuple[str | None, str, str]
"""An instance's own ``(instance_id, tier, backend)``, or a shared pool's (``None``, ...)."""


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
    content_conflicts: int = (
        0  # stores of other ids refused a binding other namespaces of the salt hold
    )


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


def module_usage(
    placements: Mapping[Module, int],
    used: Mapping[Module, int],
    capacities: Mapping[str, Mapping[tuple[str, str], int]],
    pools: Collection[tuple[str, str]],
    private: Collection[tuple[str, str, str]],
) -> list[ModuleUsage]:
    """Every module holding copies or declared, by (instance, tier, backend). An instance's
    declared ``(tier, backend)`` is a shared pool's when that is a pool (``pools``: declared
    shared, or holding shared copies), unless the instance's own config batch declared it
    private (``private``: as LMCache attributes each declaration by its ``shared`` flag)."""
    capacity: dict[Module, int] = {}
    for inst, declared in capacities.items():
        for (tier, backend), n in declared.items():
            shared = (tier, backend) in pools and (inst, tier, backend) not in private
            module = (None, tier, backend) if shared else (inst, tier, backend)
            capacity[module] = max(n, capacity.get(module, 0))
    return [
        ModuleUsage(*m, placements.get(m, 0), used.get(m, 0), capacity.get(m, 0))
        for m in sorted(placements.keys() | capacity.keys(), key=lambda m: (m[0] or "", m[1:]))
    ]
