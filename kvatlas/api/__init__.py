"""The coordinator's wire, written once: a ``msgspec.Struct`` per request body and reply, imported
by the coordinator (which encodes replies from them and decodes requests with them) and by its
clients, the node and the router (which decode replies with them). A type *is* its codec: field
names, their order and what may be absent are the contract (LMCache-compatible where LMCache
defines it), and the checks a reply must pass live on the type (msgspec constraints,
``__post_init__``), so no caller re-checks a decoded value by hand.

A field kvatlas writes only on some replies is ``UNSET`` when absent (never encoded); a field
only kvatlas sends has a default, so LMCache's replies decode too. Decoding failures are
:class:`~kvatlas.errors.Unprocessable` (:func:`decode`). This package sits low: it imports
``msgspec``, :mod:`kvatlas.errors` and nothing of the coordinator, client, node or router.
See docs/coordinator.md ("API").
"""

from kvatlas.api.codec import ErrorReply, decode, encode, from_attributes
from kvatlas.api.directory import (
    BlendHolderRow,
    BlendMatchRow,
    BlendReply,
    KeyEntryRow,
    KeyPageReply,
    KeyRow,
    LookupReply,
    LookupResultRow,
    PlacementRow,
    PrefixRow,
)
from kvatlas.api.fleet import (
    ChunkSizeReply,
    DigestBody,
    DigestReply,
    FleetUsageReply,
    HealthReply,
    HealthReplyAnyRelease,
    HeartbeatReply,
    IngestCountsReply,
    InstanceRow,
    InstancesReply,
    InstanceUsageReply,
    ModuleUsageRow,
    ReadinessReply,
    RegisteredReply,
    ReportReply,
)
from kvatlas.api.queries import (
    BlendLookupBody,
    BlendLookupQuery,
    ChunkSizeRequest,
    KeyListingQuery,
    LookupRequest,
    RegisterRequest,
    RouteScoreBody,
    RouteScorePacked,
)
from kvatlas.api.route import TIER_NAMES, RouteScoreRow, RouteScoresReply

__all__ = [
    "TIER_NAMES",
    "BlendHolderRow",
    "BlendLookupBody",
    "BlendLookupQuery",
    "BlendMatchRow",
    "BlendReply",
    "ChunkSizeReply",
    "ChunkSizeRequest",
    "DigestBody",
    "DigestReply",
    "ErrorReply",
    "FleetUsageReply",
    "HealthReply",
    "HealthReplyAnyRelease",
    "HeartbeatReply",
    "IngestCountsReply",
    "InstanceRow",
    "InstanceUsageReply",
    "InstancesReply",
    "KeyEntryRow",
    "KeyListingQuery",
    "KeyPageReply",
    "KeyRow",
    "LookupReply",
    "LookupRequest",
    "LookupResultRow",
    "ModuleUsageRow",
    "PlacementRow",
    "PrefixRow",
    "ReadinessReply",
    "RegisterRequest",
    "RegisteredReply",
    "ReportReply",
    "RouteScoreBody",
    "RouteScorePacked",
    "RouteScoreRow",
    "RouteScoresReply",
    "decode",
    "encode",
    "from_attributes",
]
