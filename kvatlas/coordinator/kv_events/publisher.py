"""Out: the directory's node placements, re-published as vLLM KV events for routers.

The directory tells the publisher (its observer, called under the directory lock, so in apply
order) about every admitted batch and every fence; the publisher only queues them. Its thread
turns them into ``KVEventBatch`` messages (vLLM's own encoding unless configured otherwise) on
a PUB socket:

* topic ``kv@<instance>@<model>``, or ``kv@pool:<backend>@<model>`` for a shared pool;
* medium ``kvatlas-l1`` / ``kvatlas-l2-<backend>``; block hashes = the 32-byte chunk hashes;
  ``block_size`` = the chunk size; ``token_ids`` when the batch carried them;
* a fence (timeout, restart, deregistration) → ``AllBlocksCleared`` on the instance's topics,
  then its surviving own L2 copies again as ``BlockStored`` (a router's clear drops every
  medium of the topic); at start every L1/L2 placement is published once.

Bounded: at most :data:`MAX_QUEUED_ENTRIES` entries wait for the thread. Beyond that the
waiting batches are dropped (counted) until the thread gets to the overflow, then every topic
it published is cleared and every node placement published again (nothing a router holds can
stay stale; the batches applied meanwhile may be published twice, which is harmless; a fence
meanwhile is in the resync too, so it is not queued).

Engine-sourced batches (tiers ``gpu``/``engine-cpu``) are never echoed; placements under a cache
salt the stream may not show (:mod:`.exposure`) are never published (``withheld_entries``). Seqs count from 0 per
publisher; the last ``--kv-events-replay-size`` messages are kept for a ROUTER replay socket
(request: the start seq; replies ``(topic, seq, payload)``…, then ``(b"", -1, b"")`` as vLLM's
own replay socket answers; with the older encodings, ``(seq, payload)``…, then ``(-1, b"")``,
the payload naming its topic). See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvatlas.coordinator.kv_events.exposure import StreamExposure
from kvatlas.coordinator.kv_events.stats import PublisherStats, view, zeroed
from kvatlas.directory import ALL_KEYS, KeyFilter
from kvatlas.events import DELETE, STORE, EventBatch
from kvatlas.events.columns import ColumnBatch
from kvatlas.events.vllm_wire import (
    DEFAULT_ENCODING,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    TopicBatch,
    VllmWireError,
    encode_batch,
    pack_seq,
    unpack_seq,
)

if TYPE_CHECKING:
    from kvatlas.directory import KeyDirectory

log = logging.getLogger(__name__)

NODE_TIERS: Final = ("l1", "l2")
REPLAY_REQUEST_MAX_BYTES: Final = 1024
MAX_QUEUED_ENTRIES = 1 << 18  # entries waiting for the thread (≈256 MB of 256-token ids)


def node_topic(instance_id: str, model: str, backend: str, shared: bool) -> str:
    return f"kv@pool:{backend}@{model}" if shared else f"kv@{instance_id}@{model}"


def node_medium(tier: str, backend: str) -> str:
    return "kvatlas-l1" if tier == "l1" else f"kvatlas-l2-{backend}"


@dataclass(frozen=True, slots=True)
class _Fence:
    instance_id: str


@dataclass(frozen=True, slots=True)
class _Resync:
    """Publish every node placement: once at start; after an overflow, with every topic
    published before cleared first."""

    overflow: bool = False


_Item = ColumnBatch | _Fence | _Resync


class KvEventsPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        replay_size: int,
        directory: KeyDirectory,
        stop: threading.Event,
        encoding: str = DEFAULT_ENCODING,
        exposure: StreamExposure | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.exposure = exposure or StreamExposure()
        self.encoding = encoding
        self.replay_endpoint = replay_endpoint
        self.chunk_size = directory.chunk_size
        self._directory = directory
        self._stop = stop
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._ring: deque[tuple[bytes, int, bytes]] = deque(maxlen=replay_size)
        self._seq = 0
        self._models: defaultdict[str, set[str]] = defaultdict(set)  # instance -> its topics
        self._pools: set[str] = set()  # shared pools' topics published
        # entries queued (by the directory's thread) and taken (by the publisher's): each
        # counter has one writer
        self._put_entries = 0
        self._taken_entries = 0
        self._overflowed = False  # batches are dropped until the thread reaches the overflow
        self._dropped_on_apply = 0  # (the directory's thread; self.counts is the publisher's)
        self.counts: Counter[str] = zeroed(PublisherStats)
        self._ctx: Any = None
        self._pub: Any = None
        self._router: Any = None
        self._authenticator: Any = None

    # ------------------------------------------------------------------ directory observer

    def applied(self, batch: ColumnBatch, fenced_first: bool) -> None:
        """Called under the directory lock: only queue (the entries become objects in the
        publisher's thread)."""
        header = batch.header
        if fenced_first:
            self.fenced(header.instance_id)
        if header.event_type not in (STORE, DELETE) or header.tier not in NODE_TIERS:
            return
        n = batch.n_entries
        if not self._overflowed and self._queued_entries() + n > MAX_QUEUED_ENTRIES:
            self._overflowed = True
            self._queue.put(_Resync(overflow=True))
        if self._overflowed:  # the resync will publish what this batch changed
            self._dropped_on_apply += 1
            return
        self._put_entries += n
        self._queue.put(batch)

    def fenced(self, instance_id: str) -> None:
        # Over the bound, the overflow's resync (waiting in the queue) reads the directory
        # after this fence, and clears every topic first: the fence is in it. Queued behind
        # the resync, its clear would remove what batches dropped after it stored.
        if not self._overflowed:
            self._queue.put(_Fence(instance_id))

    def _queued_entries(self) -> int:
        return self._put_entries - self._taken_entries

    def stats(self) -> PublisherStats:
        dropped = Counter(dropped_batches=self._dropped_on_apply)
        return view(PublisherStats, self.counts, dropped, seq=self._seq,
                    queued=self._queue.qsize(), queued_entries=self._queued_entries())  # fmt: skip

    # ------------------------------------------------------------------ sockets and loop

    def open(self) -> None:
        """Bind the sockets (raises if an endpoint is taken) and queue the initial resync."""
        import zmq

        self._ctx = zmq.Context()
        try:
            self._authenticator = self.exposure.start(self._ctx)
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.exposure.secure(self._pub)
            self._pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # a request is [b"", 8-byte seq]; ZMQ's handshake (socket type, a routing id
                # of up to 255 bytes) is held to the limit too
                self._router.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_MAX_BYTES)
                # a whole replay and its end marker queue for a router that reads later (at
                # ZMQ's 1,000 messages the ROUTER dropped the rest, the marker too, unsaid);
                # twice, as vLLM's own publisher does: a second request may come before
                self._router.setsockopt(zmq.SNDHWM, 2 * ((self._ring.maxlen or 0) + 1))
                self.exposure.secure(self._router)
                self._router.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close()
            raise
        self._queue.put(_Resync())

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    item = None
                try:
                    if item is not None:
                        self._handle(item)
                    self._serve_replay()
                except Exception:  # the publisher outlives any one bad item
                    self.counts["errors"] += 1
                    log.exception("kv events publisher: unexpected error")
        finally:
            self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(0)
        self._pub = self._router = None
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _handle(self, item: _Item) -> None:
        if isinstance(item, ColumnBatch):
            self._taken_entries += item.n_entries
            if self._overflowed:  # queued before the overflow: the resync covers it
                self.counts["dropped_batches"] += 1
            else:
                self._publish_batch(item.batch())
        elif isinstance(item, _Fence):
            if not self._overflowed:  # else the resync clears every topic anyway
                self._publish_fence(item.instance_id)
        else:
            if item.overflow:
                self._overflowed = False  # batches queue again from here on
                self._clear_every_topic()
                self.counts["overflows"] += 1
            self._republish(None)

    def _clear_every_topic(self) -> None:
        ts = time.time()
        topics = [f"kv@{inst}@{model}" for inst, models in self._models.items() for model in models]
        for topic in sorted(topics) + sorted(self._pools):
            self._send(topic, [AllBlocksCleared()], ts)
            self.counts["clears"] += 1
        self._models.clear()
        self._pools.clear()

    def _send(self, topic: str, events: list[KVEvent], ts: float) -> None:
        seq = self._seq
        self._seq += 1
        payload = encode_batch(TopicBatch(ts, events, kvatlas_topic=topic), self.encoding)
        self._pub.send_multipart([topic.encode(), pack_seq(seq), payload])
        self._ring.append((topic.encode(), seq, payload))
        self.counts["messages"] += 1

    # ------------------------------------------------------------------ placements → events

    def _publish_batch(self, batch: EventBatch) -> None:
        medium = node_medium(batch.tier, batch.backend)
        by_model: defaultdict[str, list[Any]] = defaultdict(list)
        shown = self.exposure.salts
        for entry in batch.entries:
            if entry.key.cache_salt in shown:
                by_model[entry.key.model_name].append(entry)
            else:
                self.counts["withheld_entries"] += 1
        ts = batch.ts or time.time()
        for model, entries in by_model.items():
            topic = node_topic(batch.instance_id, model, batch.backend, batch.shared)
            self._published(batch.instance_id, model, batch.shared, topic)
            hashes = list(dict.fromkeys(e.key.chunk_hash for e in entries))
            if batch.event_type == DELETE:
                self._send(topic, [BlockRemoved(hashes, medium)], ts)
                self.counts["blocks_removed"] += len(hashes)
                continue
            with_tokens = [e for e in entries if e.token_ids is not None
                           and len(e.token_ids) == self.chunk_size]  # fmt: skip
            tokened = {e.key.chunk_hash for e in with_tokens}
            events: list[KVEvent] = []
            if with_tokens:
                firsts: dict[bytes, Any] = {}
                for e in with_tokens:
                    firsts.setdefault(e.key.chunk_hash, e)
                events.append(self._stored(list(firsts), medium, list(firsts.values())))
            rest = [h for h in hashes if h not in tokened]
            if rest:
                events.append(self._stored(rest, medium, []))
            self._send(topic, events, ts)
            self.counts["blocks_stored"] += len(hashes)

    def _holds_own_l2(self, instance_id: str) -> bool:
        return any(
            m.instance_id == instance_id and m.tier == "l2" and m.placements
            for m in self._directory.usage().modules
        )

    def _stored(self, hashes: list[bytes], medium: str, entries: list[Any]) -> BlockStored:
        tokens: list[int] = []
        for e in entries:
            tokens += e.token_ids.tolist()
        return BlockStored(list(hashes), None, tokens, self.chunk_size, medium=medium)

    def _publish_fence(self, instance_id: str) -> None:
        models = self._models.pop(instance_id, None)
        if not models:  # never published (an engine, or a node without placements)
            return
        ts = time.time()
        for model in sorted(models):
            self._send(f"kv@{instance_id}@{model}", [AllBlocksCleared()], ts)
            self.counts["clears"] += 1
        self._republish(instance_id)

    def _republish(self, instance_id: str | None) -> None:
        """Publish the node placements now in the directory: every one (``None``), or the
        own L2 copies of one instance (those survive its fence; an instance without any, the
        directory's counters say so, costs no pass over the directory)."""
        if instance_id is not None and not self._holds_own_l2(instance_id):
            return
        groups: defaultdict[tuple[str, str, str, bool, str], list[bytes]] = defaultdict(list)
        cursor: str | None = None
        while True:
            own_l2 = KeyFilter(tier="l2", instance_id=instance_id) if instance_id else ALL_KEYS
            page = self._directory.list_keys(own_l2, cursor=cursor, limit=1000)
            for item in page.items:
                if item.key.cache_salt not in self.exposure.salts:
                    continue
                for p in item.placements:
                    if p.tier not in NODE_TIERS or (instance_id and p.shared):
                        continue
                    if instance_id is not None and p.instance_id != instance_id:
                        continue
                    ident = (p.instance_id, item.key.model_name, p.backend, p.shared, p.tier)
                    groups[ident].append(item.key.chunk_hash)
            cursor = page.next_cursor
            if cursor is None:
                break
        ts = time.time()
        for (inst, model, backend, shared, tier), hashes in groups.items():
            topic = node_topic(inst, model, backend, shared)
            self._published(inst, model, shared, topic)
            unique = list(dict.fromkeys(hashes))
            self._send(topic, [self._stored(unique, node_medium(tier, backend), [])], ts)
            self.counts["blocks_stored"] += len(unique)

    def _published(self, instance_id: str, model: str, shared: bool, topic: str) -> None:
        """Remember a topic a router may hold blocks of (to clear it on a fence or overflow)."""
        if shared:
            self._pools.add(topic)
        else:
            self._models[instance_id].add(model)

    # ------------------------------------------------------------------ replay

    def _serve_replay(self) -> None:
        router = self._router
        if router is None:
            return
        while router.poll(0):
            frames = router.recv_multipart()
            identity, rest = frames[0], frames[1:]
            envelope = [identity, b""] if rest[:1] == [b""] else [identity]
            if rest[:1] == [b""]:
                rest = rest[1:]
            self.counts["replay_requests"] += 1
            try:
                start = unpack_seq(rest[0]) if len(rest) == 1 else None
            except VllmWireError:
                start = None
            # vLLM's replay names each message's topic; the older one left it to the payload
            topics = self.encoding == DEFAULT_ENCODING
            if start is not None:
                for topic, seq, payload in list(self._ring):
                    if seq >= start:
                        head = [*envelope, topic] if topics else envelope
                        router.send_multipart([*head, pack_seq(seq), payload])
                        self.counts["replayed_messages"] += 1
            else:
                log.warning("kv events publisher: bad replay request of %d frames", len(rest))
            head = [*envelope, b""] if topics else envelope
            router.send_multipart([*head, pack_seq(REPLAY_END_SEQ), b""])
