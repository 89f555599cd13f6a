"""L2 adapters: where chunks go beyond L1 -- a local directory (:class:`FsL2`, ``fs``) or
Redis (:class:`RedisL2`, ``redis``), behind one contract (:mod:`kvatlas.node.l2.backend`:
errors, and every loss reported).

Modules: ``backend`` (the :class:`L2Backend` protocol, loss causes, key naming), ``fs``,
``redis_pool``.
"""

from kvatlas.node.l2.backend import (
    CORRUPT_DELETED,
    EVICTED,
    EXPIRED,
    UNREADABLE,
    VANISHED,
    FoundCallback,
    L2Backend,
    L2FullOfPins,
    L2Unavailable,
    LostCallback,
    instance_dir,
    key_digest,
)
from kvatlas.node.l2.fs import FsL2, FsL2Stats
from kvatlas.node.l2.redis_pool import RedisL2

__all__ = [
    "CORRUPT_DELETED",
    "EVICTED",
    "EXPIRED",
    "UNREADABLE",
    "VANISHED",
    "FoundCallback",
    "FsL2",
    "FsL2Stats",
    "L2Backend",
    "L2FullOfPins",
    "L2Unavailable",
    "LostCallback",
    "RedisL2",
    "instance_dir",
    "key_digest",
]
