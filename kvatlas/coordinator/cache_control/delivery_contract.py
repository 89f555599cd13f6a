"""What cache-control delivery (:mod:`.delivery`) calls and reads: an MP server's routes
(:class:`MpServer`, a client made from its URL by :data:`MpServers`) and the coordinator's view
of the fleet (:class:`Fleet`: where instances listen, who shares a pool, which copies the
directory shows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvatlas.api.cache_control import PrefetchStatusReply, PrefetchSubmitted
from kvatlas.coordinator.cache_control.moves import MoveServer
from kvatlas.errors import Unavailable
from kvatlas.keys import ObjectKey


class MpServer(MoveServer, Protocol):
    """One MP server's cache-control routes (``kvatlas.client.MPServerClient``): a move's
    calls (:class:`.moves.MoveServer`: delete, hold, release) and the prefetch's. A failure
    raises :class:`~kvatlas.errors.Unavailable` whose ``reply_status`` is the server's status
    (``None``: it could not be reached)."""

    def submit_prefetch(
        self, model_name: str, world_size: int, token_ids: Sequence[int], cache_salt: str = ""
    ) -> PrefetchSubmitted: ...

    def prefetch_status(self, request_id: str) -> PrefetchStatusReply | None: ...

    def close(self) -> None: ...


MpServers = Callable[[str], MpServer]
"""An MP server's client from its base URL."""


def no_servers(url: str) -> MpServer:
    """The client of a coordinator given none: every delivery fails (commands stay pending)."""
    raise Unavailable(f"this coordinator has no MP-server client to reach {url}")


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy the directory shows: who reported it, where, and whether a pool shares it."""

    instance_id: str
    tier: str
    backend: str
    shared: bool


class Fleet(Protocol):
    """What delivery reads of the coordinator: a registered instance's URL (``None``: not
    registered), whether an instance is registered with another replica only (the Redis
    transport's ``<stream>:instances``), the registered members of a shared L2 pool (by
    backend), the pools an instance is a member of, and the copies of keys
    (``CoordinatorService`` answers it)."""

    def url_of(self, instance_id: str) -> str | None: ...

    def registered_elsewhere(self, instance_id: str) -> bool: ...

    def gone(self, instance_id: str) -> bool: ...

    def pool_members(self, backend: str) -> list[str]: ...

    def pools_of(self, instance_id: str) -> set[str]: ...

    def copies(self, keys: Sequence[ObjectKey]) -> list[list[Copy]]: ...
