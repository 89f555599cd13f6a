"""What every L2 backend promises (``fs``: :mod:`kvatlas.node.l2.fs`, ``redis``:
:mod:`kvatlas.node.l2.redis_pool`), and the names they share.

Both store the checksummed :func:`~kvatlas.node.stored_chunk.encode_chunk` bytes, so every L2
read is verified: a torn or corrupt value is a *miss*, never wrong KV.

Error contract, shared by all backends, because L2 is a cache and a cache that is down must
degrade to recomputation, not to failed requests:

* reads (``get``, ``get_many``, ``contains``) never raise for backend trouble -- an unreachable
  server, an I/O error or a corrupt value is a miss;
* writes (``put``, ``delete``) raise :class:`L2Unavailable` when the backend cannot take them,
  so the caller knows the chunk is *not* in L2 and must not report an L2 store event for it.

Honesty contract (``docs/node.md``, "L2 bounds"): a chunk that leaves L2 by any way other than
the node's own ``delete`` -- evicted for the byte cap, found corrupt, expired or evicted by
Redis -- is reported to the ``on_lost`` callback given to :meth:`L2Backend.attach` (the node
turns it into a ``delete`` event), and a restarted node learns what its private fs L2 really
holds from :meth:`FsL2.rescan` (``on_found``), so the directory never keeps a placement whose
bytes are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

import blake3
import msgspec

from kvatlas.errors import InvalidInput, Unavailable
from kvatlas.keys import ObjectKey, check_instance_id
from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk, decode_chunk

log = logging.getLogger(__name__)

_key_json = msgspec.json.Encoder(order="sorted")


LostCallback = Callable[[ObjectKey, str], None]
"""``on_lost(key, cause)``: ``key`` left L2 without the node deleting it; ``cause`` is one of
:data:`EVICTED`, :data:`CORRUPT_DELETED`, :data:`EXPIRED`, :data:`VANISHED`,
:data:`UNREADABLE`."""
FoundCallback = Callable[[StoredChunk], bool]
"""``on_found(chunk)``: a chunk a private store already held at start-up; returns whether the
node holds it (``False``: another KV layout's chunk, kept on disk but not held)."""
EVICTED: Final = "evicted"
"""Removed to stay under the byte cap (fs), or by Redis under ``maxmemory``."""
CORRUPT_DELETED: Final = "corrupt_deleted"
"""A torn, truncated or corrupt file, deleted instead of served."""
EXPIRED: Final = "expired"
"""Its Redis TTL ran out."""
VANISHED: Final = "vanished"
"""Gone without a word (someone else deleted it; a Redis restart; seen by a sweep or a read)."""
UNREADABLE: Final = "unreadable"
"""A file the filesystem refuses to read (``EIO``, ``EACCES``, ...): removed when it can be,
no longer held, so the next store of its key writes it again."""


class L2Unavailable(Unavailable):
    """An L2 write (put/delete) could not be applied: the backend is down, full or failing.

    An :class:`~kvatlas.errors.Unavailable` (so still a ``RuntimeError``)."""


class L2FullOfPins(L2Unavailable):
    """A capped L2 could only take the chunk by evicting pinned keys: refused, nothing evicted."""


def key_digest(key: ObjectKey) -> str:
    """A fixed-length, filesystem- and Redis-safe name for ``key``.

    Hashes the *full* wire form (model names hold '/', salts separate tenants), so two keys that
    differ in any field never share a file or a Redis key.
    """
    return blake3.blake3(_key_json.encode(key.to_wire())).hexdigest()


def instance_dir(root: Path, instance_id: str) -> Path:
    """The fs L2 directory of one instance under ``root``: ``instance_id`` must be a valid
    id (:func:`~kvatlas.keys.check_instance_id`) and the resolved path (symlinks followed)
    must lie strictly inside the resolved ``root``, or :class:`~kvatlas.errors.InvalidInput`
    (an id is a name, never a way out of the L2 root)."""
    try:
        check_instance_id(instance_id)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    base = Path(root).resolve()
    path = (base / instance_id).resolve()
    if path == base or not path.is_relative_to(base):
        raise InvalidInput(f"instance directory {path} is not inside the L2 root {base}")
    return path


@runtime_checkable
class L2Backend(Protocol):
    """What the node needs from an L2 tier (see the module docstring for the error contract).

    ``shared`` says whether other nodes read the same store (a fleet-wide pool): the events of
    a shared backend are fleet placements, not this node's.
    """

    name: str
    shared: bool

    def put(self, chunk: StoredChunk) -> None: ...

    def get(self, key: ObjectKey) -> StoredChunk | None: ...

    def get_many(self, keys: Iterable[ObjectKey]) -> dict[ObjectKey, StoredChunk]: ...

    def delete(self, key: ObjectKey) -> bool: ...

    def contains(self, key: ObjectKey) -> bool: ...

    def attach(self, on_found: FoundCallback, on_lost: LostCallback) -> None:
        """Start reporting: ``on_found`` for each chunk a private store already holds (a
        restart; a chunk it refuses is not held), ``on_lost`` from now on for each chunk that
        leaves without ``delete``."""
        ...

    def close(self) -> None: ...


def decode_for(key: ObjectKey, data: bytes, where: str) -> StoredChunk | None:
    try:
        chunk = decode_chunk(data)
    except ChunkDecodeError as exc:
        log.warning("corrupt L2 value for %s in %s: %s", key, where, exc)
        return None
    # A digest collision (or a value written under a foreign scheme) must not hand back
    # another key's KV.
    return chunk if chunk.key == key else None
