"""Cache control on the coordinator, below HTTP (``docs/cache-control.md``): pins with
reference counts (:mod:`.pins`), quotas per salt with LMCache's semantics (:mod:`.quotas`),
durable commands carried to completion (:mod:`.commands`), the operations the routes call
(:mod:`.service`) and their snapshot section (:mod:`.snapshot`). Nothing here imports HTTP."""

from kvatlas.coordinator.cache_control.commands import Command, CommandLog, Retry
from kvatlas.coordinator.cache_control.pins import PinTable
from kvatlas.coordinator.cache_control.quotas import QuotaTable, salt_of_path
from kvatlas.coordinator.cache_control.service import (
    CacheControl,
    DeleteOutcome,
    PrefetchOutcome,
    Resolved,
)
from kvatlas.coordinator.cache_control.snapshot import (
    SECTION,
    encode_state,
    restore_section,
    restore_state,
)

__all__ = [
    "SECTION",
    "CacheControl",
    "Command",
    "CommandLog",
    "DeleteOutcome",
    "PinTable",
    "PrefetchOutcome",
    "QuotaTable",
    "Resolved",
    "Retry",
    "encode_state",
    "restore_section",
    "restore_state",
    "salt_of_path",
]
