"""What a node needs to know about the rest of the fleet to fetch a chunk it does not hold:
who holds which key (the coordinator's directory) and how to reach that holder's L1.

Two implementations: over HTTP (coordinator lookup + the peers' advertised URLs from
``GET /instances``) and in-process (the embedded fleet). Every failure is a miss, never an
exception: fetching from the fleet is an optimisation over recomputing. Coordinator replies are
read with :mod:`kvatlas.coordinator.wire`, the module that writes them (docs/node.md,
docs/coordinator.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvatlas.client import CoordinatorClient, CoordinatorError
from kvatlas.coordinator.wire import instance_from_wire, lookup_placements_from_wire
from kvatlas.keys import ObjectKey
from kvatlas.node.peer import PeerClient
from kvatlas.node.stored_chunk import StoredChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Holder:
    instance_id: str
    tier: str
    backend: str
    shared: bool


class PeerFetcher(Protocol):
    def fetch(
        self, keys: Sequence[ObjectKey], tokens: Mapping[ObjectKey, Any] | None = None
    ) -> dict[ObjectKey, StoredChunk]:
        """The chunks of ``keys`` the peer holds; ``tokens``: the requester's own token ids
        per key, attached to a chunk whose token digest matches (``kvatlas.node.peer``)."""
        ...


class FleetView(Protocol):
    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]: ...

    def peer(self, instance_id: str) -> PeerFetcher | None: ...


class HttpFleetView:
    """Placements from ``POST /directory/lookup``; peer URLs from ``GET /instances``."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        peer_timeout: float = 2.0,
        peer_token: str | None = None,
    ) -> None:
        """``peer_token`` is sent on every ``/peer/*`` call (peers with auth on need it)."""
        self._client = client
        self._peer_timeout = peer_timeout
        self._peer_token = peer_token
        self._urls: dict[str, str] = {}
        self._peers: dict[str, PeerClient] = {}
        self._lock = threading.Lock()

    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]:
        if not keys:
            return []
        try:
            found = lookup_placements_from_wire(self._client.lookup_keys(list(keys)))
        except (CoordinatorError, ValueError) as exc:
            log.debug("fleet lookup failed: %s", exc)
            return [[] for _ in keys]
        if len(found) != len(keys):
            return [[] for _ in keys]
        return [[Holder(p.instance_id, p.tier, p.backend, p.shared) for p in pls] for pls in found]

    def peer(self, instance_id: str) -> PeerFetcher | None:
        with self._lock:
            known = self._peers.get(instance_id)
        if known is not None:
            return known
        self._refresh_urls()
        with self._lock:
            url = self._urls.get(instance_id)
            if url is None:
                return None
            client = self._peers.setdefault(
                instance_id, PeerClient(url, timeout=self._peer_timeout, token=self._peer_token)
            )
            return client

    def _refresh_urls(self) -> None:
        try:
            views = [instance_from_wire(row) for row in self._client.instances()]
        except (CoordinatorError, KeyError, TypeError, ValueError) as exc:
            log.debug("instance list unavailable: %s", exc)
            return
        with self._lock:
            for view in views:
                reg = view.registration
                if reg is not None and reg.p2p_advertised_url:
                    self._urls[view.instance_id] = reg.p2p_advertised_url


class InProcessFleetView:
    """The embedded fleet: the directory and the other nodes live in this process."""

    def __init__(
        self,
        holders: Callable[[Sequence[ObjectKey]], list[list[Holder]]],
        peers: Callable[[str], PeerFetcher | None],
    ) -> None:
        self._holders = holders
        self._peers = peers

    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]:
        return self._holders(keys)

    def peer(self, instance_id: str) -> PeerFetcher | None:
        return self._peers(instance_id)
