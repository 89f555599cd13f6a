"""Cache control on the coordinator, below HTTP (``docs/cache-control.md``): pins with
reference counts (:mod:`.pins`), quotas per salt with LMCache's semantics (:mod:`.quotas`),
durable commands carried to completion (:mod:`.commands`) and the operations the routes call
(:mod:`.service`). Nothing here imports HTTP."""

from kvatlas.coordinator.cache_control.commands import Command, CommandLog, Retry
from kvatlas.coordinator.cache_control.pins import PinTable
from kvatlas.coordinator.cache_control.quotas import DEFAULT_SALT_NAME, QuotaTable, salt_of_path
from kvatlas.coordinator.cache_control.service import (
    CacheControl,
    DeleteOutcome,
    PrefetchOutcome,
    Resolved,
)

__all__ = [
    "DEFAULT_SALT_NAME",
    "CacheControl",
    "Command",
    "CommandLog",
    "DeleteOutcome",
    "PinTable",
    "PrefetchOutcome",
    "QuotaTable",
    "Resolved",
    "Retry",
    "salt_of_path",
]
