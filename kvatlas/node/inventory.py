"""What this node holds on its own tiers, with inventory digests, and the resync that repairs
the coordinator's view of it (convergence.md §3; docs/node.md, "Resync").

:class:`NodeInventory` follows the node's own ``store``/``delete`` reports (shared pools are
not the node's: they are left out) and keeps a root digest per tier incrementally, with the
same elements as the coordinator (:mod:`kvatlas.events.inventory`).

:class:`ResyncDriver` runs a digest exchange — periodically, after every (re-)registration,
when the coordinator asks for one (heartbeat hint) and when the node's event sink lost batches
(a gap): it compares root digests, refines buckets holding more than ``refine_above``
placements by their one-byte digests, and sends a ``resync`` batch listing every placement of
each differing prefix. The listing is taken while the emitter records nothing, and goes out
behind every event recorded before it, so the coordinator's view after applying it is exact.
A *full listing* (:meth:`ResyncDriver.want_listing`: a replica that lost events asked for it
through the one the node heartbeats to) sends every bucket of every tier without asking: the
batches reach every replica, and the one that asked has no exchange with this node.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvatlas.events import RESYNC, CacheEntry
from kvatlas.events.inventory import (
    BUCKETS,
    Digest,
    digest_to_hex,
    empty_digest,
    placement_element,
)
from kvatlas.keys import ObjectKey

log = logging.getLogger(__name__)

Held = dict[ObjectKey, tuple[str, CacheEntry, int]]  # key -> (backend, entry, element)
TokensOf = Callable[[bytes], "tuple[Any, int] | None"]  # chunk hash -> (tokens, offset)


class NodeInventory:
    """Own placements per tier (by first chunk-hash byte) and their root digests.

    Entries are kept without token ids (an L2 may hold millions of chunks; their tokens would
    be a KiB each): a listing adds them from ``tokens_of`` (the node's bounded token cache)
    where it still knows them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[Held]] = {}
        self._digests: dict[str, Digest] = {}

    def _tier(self, tier: str) -> list[Held]:
        held = self._held.get(tier)
        if held is None:
            held = self._held[tier] = [{} for _ in range(BUCKETS)]
            self._digests[tier] = empty_digest()
        return held

    def add(self, tier: str, backend: str, entry: CacheEntry) -> None:
        """``tier`` holds ``entry.key`` on ``backend`` (idempotent; a newer entry replaces)."""
        key = entry.key
        b = key.chunk_hash[0]
        with self._lock:
            bucket = self._tier(tier)[b]
            old = bucket.get(key)
            if entry.token_ids is not None:
                entry = CacheEntry(key, entry.size_bytes, None, entry.token_offset)
            if old is not None and old[0] == backend:
                bucket[key] = (backend, entry, old[2])
                return
            e = placement_element(key, tier, backend)
            digest = self._digests[tier]
            if old is not None:
                digest[b] ^= old[2]
            digest[b] ^= e
            bucket[key] = (backend, entry, e)

    def remove(self, tier: str, backend: str, key: ObjectKey) -> None:
        """``tier`` no longer holds ``key`` on ``backend`` (absent: nothing happens)."""
        b = key.chunk_hash[0]
        with self._lock:
            bucket = self._tier(tier)[b]
            old = bucket.get(key)
            if old is None or old[0] != backend:
                return
            del bucket[key]
            self._digests[tier][b] ^= old[2]

    def digest(self, tier: str, prefix: bytes = b"") -> Digest:
        """The root digest, or a one-byte prefix's (one bucket per second byte)."""
        with self._lock:
            held = self._tier(tier)
            if not prefix:
                return list(self._digests[tier])
            out = empty_digest()
            for key, (_, _, e) in held[prefix[0]].items():
                out[key.chunk_hash[1]] ^= e
            return out

    def count(self, tier: str, prefix: bytes) -> int:
        """Placements under a one-byte ``prefix``."""
        with self._lock:
            return len(self._tier(tier)[prefix[0]])

    def listing(
        self, tier: str, prefixes: Iterable[bytes], tokens_of: TokensOf | None = None
    ) -> list[CacheEntry]:
        """Every entry of ``tier`` under one of ``prefixes`` (one or two bytes), with its
        tokens where ``tokens_of`` knows them."""
        out: list[CacheEntry] = []
        with self._lock:
            held = self._tier(tier)
            for p in prefixes:
                out += [e for k, (_, e, _) in held[p[0]].items() if k.chunk_hash.startswith(p)]
        if tokens_of is None:
            return out
        for i, e in enumerate(out):
            known = tokens_of(e.key.chunk_hash)
            if known is not None:
                out[i] = CacheEntry(e.key, e.size_bytes, known[0], known[1])
        return out

    def placements(self) -> list[tuple[ObjectKey, str, str]]:
        """``(key, tier, backend)`` of every own placement."""
        with self._lock:
            return [
                (key, tier, backend)
                for tier, held in self._held.items()
                for bucket in held
                for key, (backend, _, _) in bucket.items()
            ]


class DigestExchange(Protocol):
    def __call__(self, tiers: dict[str, dict[str, str]]) -> dict[str, list[str]]:
        """``POST /instances/{id}/digest``: digests by tier and prefix hex → differing prefixes."""
        ...


@dataclass(frozen=True, slots=True)
class ResyncReport:
    """One digest exchange: rounds asked, prefixes listed, resync batches and entries sent."""

    rounds: int = 0
    prefixes: int = 0
    batches: int = 0
    entries: int = 0


SendResync = Callable[[str, str, tuple[str, ...], list[CacheEntry]], None]
"""``(tier, backend, prefixes hex, entries)``: queue one resync batch."""


class ResyncDriver:
    """Runs digest exchanges for one node (see the module docstring).

    ``backends`` names the node's own backend per tier (its private tiers only);
    ``exchange`` asks the coordinator; ``barrier(action)`` runs ``action(send)`` while the
    node records no event, with ``send`` queueing one resync batch behind everything recorded;
    ``settle`` waits until what was recorded has been delivered (best effort); ``lost``
    returns how many batches the sink dropped or had refused so far (a growing count is a
    gap: exchange now); ``tokens_of`` adds known token ids to listed entries (a chunk the
    coordinator had dropped is then indexed again for blend lookup)."""

    def __init__(
        self,
        inventory: NodeInventory,
        backends: dict[str, str],
        *,
        exchange: DigestExchange,
        barrier: Callable[[Callable[[SendResync], None]], None],
        settle: Callable[[], object] = lambda: None,
        lost: Callable[[], int] = lambda: 0,
        tokens_of: TokensOf | None = None,
        interval: float = 30.0,
        refine_above: int = 64,
        max_entries: int = 1000,
    ) -> None:
        self.inventory = inventory
        self.backends = dict(backends)
        self._exchange = exchange
        self._barrier = barrier
        self._settle = settle
        self._lost = lost
        self._tokens_of = tokens_of
        self.interval = interval
        self.refine_above = refine_above
        self.max_entries = max_entries
        self.wanted = threading.Event()
        self._listing = threading.Event()  # the next run lists everything
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.exchanges = 0
        self.failures = 0
        self.last: ResyncReport | None = None

    # ------------------------------------------------------------------ one exchange

    def want_listing(self) -> None:
        """The next run lists every placement of every own tier (a full listing)."""
        self._listing.set()
        self.wanted.set()

    def run_once(self, list_all: bool = False) -> ResyncReport:
        """Compare digests with the coordinator and send resync batches where they differ;
        with ``list_all``, send every bucket without comparing (a full listing). Raises
        whatever ``exchange`` raises (the coordinator is unreachable, ...)."""
        self._settle()
        if list_all:
            return self._send({t: [bytes([b]) for b in range(BUCKETS)] for t in self.backends}, 0)
        inv = self.inventory
        root = {t: {"": digest_to_hex(inv.digest(t))} for t in self.backends}
        differ = self._exchange(root)
        rounds = 1
        final: dict[str, list[bytes]] = {}
        refine: dict[str, dict[str, str]] = {}
        for tier, prefixes in differ.items():
            if tier not in self.backends:
                continue
            for p in map(bytes.fromhex, prefixes):
                if len(p) == 1 and inv.count(tier, p) > self.refine_above:
                    refine.setdefault(tier, {})[p.hex()] = digest_to_hex(inv.digest(tier, p))
                else:
                    final.setdefault(tier, []).append(p)
        if refine:
            rounds += 1
            for tier, prefixes in self._exchange(refine).items():
                if tier in self.backends:
                    final.setdefault(tier, []).extend(map(bytes.fromhex, prefixes))
        return self._send(final, rounds)

    def _send(self, final: dict[str, list[bytes]], rounds: int) -> ResyncReport:
        """Resync batches listing ``final``'s prefixes per tier, behind everything recorded."""
        sent = [0, 0]

        def send_all(send: SendResync) -> None:
            for tier, prefixes in final.items():
                for group, entries in self._groups(tier, prefixes):
                    send(tier, self.backends[tier], group, entries)
                    sent[0] += 1
                    sent[1] += len(entries)

        if final:
            self._barrier(send_all)
        self.exchanges += 1
        report = ResyncReport(rounds, sum(map(len, final.values())), sent[0], sent[1])
        self.last = report
        if report.prefixes:
            log.info(
                "resync: %d prefixes %s; %d batches, %d entries sent", report.prefixes,
                "differed" if rounds else "listed", report.batches, report.entries,
            )  # fmt: skip
        return report

    def _groups(
        self, tier: str, prefixes: list[bytes]
    ) -> Iterable[tuple[tuple[str, ...], list[CacheEntry]]]:
        """Whole prefixes per batch, about ``max_entries`` entries each (a prefix is never
        split: a resync batch replaces everything under its prefixes)."""
        group: list[str] = []
        entries: list[CacheEntry] = []
        for p in sorted(set(prefixes)):
            listed = self.inventory.listing(tier, [p], self._tokens_of)
            if group and len(entries) + len(listed) > self.max_entries:
                yield tuple(group), entries
                group, entries = [], []
            group.append(p.hex())
            entries += listed
        if group:
            yield tuple(group), entries

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvatlas-resync", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        import time

        last_run = float("-inf")
        lost_seen = self._lost()
        streak = 0  # failed exchanges in a row
        pause = 0.0  # before an exchange for losses that follow one for losses (see below)
        while not self._stop.is_set():
            self.wanted.wait(min(1.0, self.interval))
            if self._stop.is_set():
                return
            lost = self._lost()
            since = time.monotonic() - last_run
            if lost == lost_seen and since >= max(pause, 1.0):
                pause = 0.0  # the last exchange's batches were not lost
            if not (self.wanted.is_set() or lost != lost_seen or since >= self.interval):
                continue
            # The sink lost batches again since the last exchange, whose listing may be among
            # them (a refusal that persists, a clock far ahead, refuses every listing): wait
            # twice as long each time (2 s, 4 s, ... up to the interval) rather than list the
            # same prefixes each second for nothing
            if lost != lost_seen and since < pause:
                continue
            self.wanted.clear()
            list_all = self._listing.is_set()
            self._listing.clear()
            try:
                self.run_once(list_all)
                pause = min(self.interval, max(2.0, 2 * pause)) if lost != lost_seen else 0.0
                lost_seen = lost
                streak = 0
            except Exception as exc:  # the coordinator may be down: try again, backing off
                self.failures += 1
                streak += 1
                log.warning("digest exchange failed (%d in a row): %s", streak, exc)
                if list_all:
                    self._listing.set()
                self.wanted.set()
                self._stop.wait(min(self.interval, 0.5 * 2**streak))
            last_run = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self.wanted.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def resync_sender(sink: Any) -> SendResync:
    """A :data:`SendResync` that queues on an event sink (``emit(..., prefixes=...)``)."""

    def send(tier: str, backend: str, prefixes: tuple[str, ...], entries: list[CacheEntry]) -> None:
        sink.emit(RESYNC, tier, backend, entries, prefixes=prefixes)

    return send


__all__ = ["NodeInventory", "ResyncDriver", "ResyncReport", "resync_sender"]
