"""Key directory: ingest gate, placements, token bindings, blend index, snapshots."""

from kvatlas.directory.blend_index import BlendIndex, BlendMatch
from kvatlas.directory.gate import Admission, EmitterCursor, GapRecord, IngestGate, Outcome
from kvatlas.directory.key_directory import IngestCounts, KeyDirectory
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPage,
    KeyPlacements,
    Placement,
    PrefixHolder,
    TokenLookup,
)
from kvatlas.directory.snapshot import SnapshotInfo, load_snapshot, save_snapshot

__all__ = [
    "Admission",
    "BlendIndex",
    "BlendMatch",
    "CapacityDeclaration",
    "EmitterCursor",
    "GapRecord",
    "IngestCounts",
    "IngestGate",
    "KeyDirectory",
    "KeyPage",
    "KeyPlacements",
    "Outcome",
    "Placement",
    "PrefixHolder",
    "SnapshotInfo",
    "TokenLookup",
    "load_snapshot",
    "save_snapshot",
]
