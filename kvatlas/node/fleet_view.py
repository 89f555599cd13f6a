"""What a node needs to know about the rest of the fleet to fetch a chunk it does not hold:
who holds which key (the coordinator's directory) and how to reach that holder's L1.

Two implementations: over HTTP (coordinator lookup + the peers' advertised URLs from
``GET /instances``) and in-process (the embedded fleet). Every failure is a miss, never an
exception: fetching from the fleet is an optimisation over recomputing. Coordinator replies are
decoded as the :mod:`kvatlas.api` types the coordinator writes them from (docs/node.md,
docs/coordinator.md).

The HTTP view keeps the instance list it last read and re-reads it at most once every
``refresh_interval`` seconds, whatever asks: a placement naming an instance that has no URL
(it emits without registering, or left) is a miss until the next due refresh, never a fresh
download of the whole list per retrieval.

With the fleet's peer secret, a listed URL is used only when its signature verifies (a node
registered it, :mod:`kvatlas.node.peer_credentials`), and each peer gets the credential
derived for it: nothing is ever sent to a URL that a caller without the secret registered
(counted ``peer_url_unverified`` when a placement names such an instance).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvatlas.client import CoordinatorClient, CoordinatorError
from kvatlas.keys import ObjectKey
from kvatlas.logs import Throttle
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.peer import PeerClient, PeerReply, max_chunk_bytes
from kvatlas.node.peer_credentials import PeerSecret

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Holder:
    instance_id: str
    tier: str
    backend: str
    shared: bool


class PeerFetcher(Protocol):
    def fetch(self, keys: Sequence[ObjectKey], tiers: Sequence[str] = ...) -> PeerReply:
        """The chunks the peer holds in ``tiers`` (default its L1; ``"l2"``: its private L2)."""
        ...


class FleetView(Protocol):
    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]: ...

    def peer(self, instance_id: str) -> PeerFetcher | None: ...


class HttpFleetView:
    """Placements from ``POST /directory/lookup``; peer URLs from ``GET /instances``, cached
    (module docstring). Peers are reached under ``peer_deadline`` per fetch, replies bounded
    by ``layout`` (:class:`~kvatlas.node.peer.PeerClient`); with ``peer_secret`` only at
    signed URLs, each with its own credential. Refusals are counted in ``counters`` (the node
    process points it at the node's)."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        layout: KVLayout,
        peer_deadline: float = 2.0,
        peer_secret: PeerSecret | None = None,
        refresh_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._layout = layout
        self._max_chunk_bytes = max_chunk_bytes(layout)
        self._peer_deadline = peer_deadline
        self._secret = peer_secret
        self._refresh_interval = refresh_interval
        self._clock = clock
        self._refreshed_at: float | None = None
        self._urls: dict[str, str] = {}
        self._unverified: dict[str, str] = {}  # instance id -> a URL no node signed
        self._foreign: dict[str, str] = {}  # instance id -> the other KV layout it registered
        self._peers: dict[str, PeerClient] = {}
        self._lock = threading.Lock()
        self._warnings = Throttle(60.0)
        self.counters: Counter[str] = Counter()
        self.refreshes = 0
        """``GET /instances`` calls made so far."""

    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]:
        if not keys:
            return []
        try:
            found = self._client.lookup_keys(list(keys)).results
        except CoordinatorError as exc:
            log.debug("fleet lookup failed: %s", exc)
            return [[] for _ in keys]
        if len(found) != len(keys):
            return [[] for _ in keys]
        return [
            [Holder(p.instance_id, p.tier, p.backend, p.shared) for p in r.placements]
            for r in found
        ]

    def peer(self, instance_id: str) -> PeerFetcher | None:
        if self._refresh_due():
            self._refresh()
        with self._lock:
            client = self._peers.get(instance_id)
            url = self._urls.get(instance_id)
            if client is None and url is not None:
                token = None if self._secret is None else self._secret.credential(instance_id)
                client = self._peers[instance_id] = PeerClient(
                    url, max_chunk_bytes=self._max_chunk_bytes,
                    deadline=self._peer_deadline, token=token,
                )  # fmt: skip
            unverified = self._unverified.get(instance_id) if client is None else None
            foreign = self._foreign.get(instance_id)
        if foreign is not None:
            self._skipped(
                instance_id, "peer_skipped_foreign_layout", "instance %s holds KV of another "
                "layout (%s; this node's %s, %s) under this node's keys: its copies are not used "
                "(another dtype or shape of the model under one --model-name)", foreign,
                self._layout.dtype, list(self._layout.shape),
            )  # fmt: skip
            return None
        if unverified is not None:
            self._skipped(
                instance_id, "peer_url_unverified", "instance %s advertises %s without a valid "
                "signature of the fleet's peer secret (registered by a caller that is not a "
                "node, or a node with another or no --peer-token-file): not contacted", unverified,
            )  # fmt: skip
        return client

    def _skipped(self, instance_id: str, counter: str, message: str, *args: object) -> None:
        """A listed peer not asked: counted, and a WARNING at most once a minute per peer."""
        self.counters[counter] += 1
        if self._warnings(instance_id):
            log.warning(message, instance_id, *args)

    def _refresh_due(self) -> bool:
        """Claims the refresh when one is due, so concurrent callers make one call."""
        now = self._clock()
        with self._lock:
            if self._refreshed_at is not None and now - self._refreshed_at < self._refresh_interval:
                return False
            self._refreshed_at = now
            return True

    def _refresh(self) -> None:
        """Re-read the instance list (peer clients are made on first use; a moved or departed
        peer's client is closed). A failed read keeps what is known until the next due one."""
        self.refreshes += 1
        try:
            rows = self._client.instances()
        except CoordinatorError as exc:
            log.debug("instance list unavailable: %s", exc)
            return
        urls: dict[str, str] = {}
        unverified: dict[str, str] = {}
        foreign: dict[str, str] = {}
        for row in rows:
            url = row.peer_url
            if url is None:
                continue
            other = self._other_layout(row.metadata)
            if other is not None:
                foreign[row.instance_id] = other
                continue
            secret = self._secret
            if secret is None or secret.url_signed(row.instance_id, url, row.signature):
                urls[row.instance_id] = url
            else:
                unverified[row.instance_id] = url
        with self._lock:
            self._urls = urls
            self._unverified = unverified
            self._foreign = foreign
            moved = [i for i, c in self._peers.items() if urls.get(i) != c.url]
            gone = [self._peers.pop(i) for i in moved]
        for client in gone:
            client.close()

    def _other_layout(self, metadata: object) -> str | None:
        """The KV layout a peer registered (``kv_shape``, ``kv_dtype``: kvatlas nodes since
        they are sent) when it is not this node's, as text; ``None`` when it is this node's or
        unsaid (then a chunk of another layout is refused at fetch: ``tiered_fetch``)."""
        if not isinstance(metadata, dict):
            return None
        shape, dtype = metadata.get("kv_shape"), metadata.get("kv_dtype")
        if not isinstance(shape, list) or not isinstance(dtype, str):
            return None
        if self._layout.fits(tuple(shape), dtype):
            return None
        return f"{dtype}, {shape}"

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for client in peers:
            client.close()


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
