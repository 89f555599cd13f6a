"""Key directory: ingest gate, placements, token bindings, blend index, snapshots
(docs/directory.md, docs/blend-index.md)."""

from kvatlas.directory.blend import (
    AddColumns,
    AddOp,
    BlendIndex,
    BlendOp,
    BlendStats,
    MatchColumns,
    RemoveChunkOp,
    RemoveClaimColumns,
    RemoveClaimOp,
)
from kvatlas.directory.capture import Capture, CapturedPart, DirectoryState, Restored
from kvatlas.directory.gate import Admission, EmitterCursor, GapRecord, IngestGate, Outcome
from kvatlas.directory.key_directory import KeyDirectory, PlacementObserver
from kvatlas.directory.listing import ALL_KEYS, KeyFilter, page_keys
from kvatlas.directory.prefixes import prefix_summary
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPage,
    KeyPlacements,
    Placement,
    PrefixHolder,
    TokenLookup,
)
from kvatlas.directory.snapshot import (
    InstanceRow,
    SnapshotError,
    SnapshotInfo,
    load_snapshot,
    remove_stale_temps,
    save_snapshot,
)
from kvatlas.directory.summaries import DirectoryStats, DirectoryUsage, IngestCounts, ModuleUsage
from kvatlas.directory.warm_up import warm_up_kernels
from kvatlas.keys import BlendMatch

__all__ = [
    "ALL_KEYS",
    "AddColumns",
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
    "DirectoryUsage",
    "EmitterCursor",
    "GapRecord",
    "IngestCounts",
    "IngestGate",
    "InstanceRow",
    "KeyDirectory",
    "KeyFilter",
    "KeyPage",
    "KeyPlacements",
    "MatchColumns",
    "ModuleUsage",
    "Outcome",
    "Placement",
    "PlacementObserver",
    "PrefixHolder",
    "RemoveChunkOp",
    "RemoveClaimColumns",
    "RemoveClaimOp",
    "Restored",
    "SnapshotError",
    "SnapshotInfo",
    "TokenLookup",
    "load_snapshot",
    "page_keys",
    "prefix_summary",
    "remove_stale_temps",
    "save_snapshot",
    "warm_up_kernels",
]
