"""Key directory: ingest gate, placements, token bindings, blend index, snapshots."""

from kvatlas.directory.blend import (
    AddOp,
    BlendIndex,
    BlendOp,
    BlendStats,
    RemoveChunkOp,
    RemoveClaimOp,
)
from kvatlas.directory.capture import Capture, CapturedPart, DirectoryState, Restored
from kvatlas.directory.gate import Admission, EmitterCursor, GapRecord, IngestGate, Outcome
from kvatlas.directory.key_directory import DirectoryStats, IngestCounts, KeyDirectory
from kvatlas.directory.listing import page_keys
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPage,
    KeyPlacements,
    Placement,
    PrefixHolder,
    TokenLookup,
)
from kvatlas.directory.snapshot import SnapshotError, SnapshotInfo, load_snapshot, save_snapshot
from kvatlas.keys import BlendMatch

__all__ = [
    "AddOp",
    "Admission",
    "BlendIndex",
    "BlendMatch",
    "BlendOp",
    "BlendStats",
    "CapacityDeclaration",
    "Capture",
    "CapturedPart",
    "DirectoryState",
    "DirectoryStats",
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
    "Restored",
    "SnapshotError",
    "SnapshotInfo",
    "TokenLookup",
    "load_snapshot",
    "page_keys",
    "save_snapshot",
]
