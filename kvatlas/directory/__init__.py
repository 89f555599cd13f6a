"""Key directory: ingest gate, placements, token bindings, blend index, snapshots."""

from kvatlas.directory.blend import (
    AddOp,
    BlendIndex,
    BlendOp,
    BlendStats,
    RemoveChunkOp,
    RemoveClaimOp,
)
from kvatlas.directory.gate import Admission, EmitterCursor, GapRecord, IngestGate, Outcome
from kvatlas.directory.key_directory import IngestCounts, KeyDirectory, page_keys
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPage,
    KeyPlacements,
    Placement,
    PrefixHolder,
    TokenLookup,
)
from kvatlas.directory.snapshot import SnapshotInfo, load_snapshot, save_snapshot
from kvatlas.keys import BlendMatch

__all__ = [
    "AddOp",
    "Admission",
    "BlendIndex",
    "BlendMatch",
    "BlendOp",
    "BlendStats",
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
    "RemoveChunkOp",
    "RemoveClaimOp",
    "SnapshotInfo",
    "TokenLookup",
    "load_snapshot",
    "page_keys",
    "save_snapshot",
]
