"""In: vLLM engines' KV events, subscribed over ZMQ and applied to the directory.

One thread polls a SUB socket per endpoint (:mod:`.endpoints`): connected
(``--kv-events-subscribe``, to a vLLM publisher that binds) or bound (``--kv-events-bind``, for
a vLLM publisher that connects). An endpoint speaks for the engine the operator named for it
(``ENGINE=ENDPOINT``; its topics may then be vLLM's default empty one) or, unnamed, for the
engines its topics name, at most ``--kv-events-max-engines-per-endpoint``; a topic naming a
registered node, another endpoint's engine or one engine too many is refused and counted. Each
message is checked (three frames, topic, seq, payload), decoded
(:mod:`kvatlas.events.vllm_wire`), re-keyed (:mod:`.rekey`) and applied through the same calls
as HTTP and Redis batches: the service's ``ingest`` and the directory's fence for
``AllBlocksCleared``. Seqs are followed per endpoint and topic. A seq jump is a gap: with a
replay endpoint (``--kv-events-replay``, same position in the list) the missing batches are
asked for (DEALER → the engine's ROUTER; vLLM's reply frames ``topic, seq, payload`` or the
older ``seq, payload``) and applied first; what stays missing shows as a gap of the engine's
instance at the gate (``GET /instances``). A seq going back is an engine restart (a new
incarnation, counting from seq 0: the seqs before the one heard are asked of the replay endpoint
from 0, else a gap). Bad input is counted and logged, never raised; a bad batch changes nothing.

No message costs other threads more than a bounded pause: every socket that receives from
outside refuses a frame above ``--kv-events-max-message-bytes`` (ZMQ drops that peer's
connection: counted as ``disconnects``, and a connected endpoint is connected again), events
are decoded and token ids converted in bounded pieces, and a translated batch is applied as
gated batches of at most :data:`~.rekey.SLICE_ENTRIES` entries, one directory call each (the
lock and the GIL free between them). A slice that fails leaves the rest unapplied and is at once
a gap of the engine at the gate, never a silent loss. See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final

from kvatlas.coordinator.kv_events.batch_checks import BadBatch
from kvatlas.coordinator.kv_events.changes import Cleared
from kvatlas.coordinator.kv_events.endpoints import Endpoints, Link
from kvatlas.coordinator.kv_events.rekey import Rekeyer
from kvatlas.coordinator.kv_events.settings import (
    SubscriberSettings,
    engine_instance,
    engine_of,
)
from kvatlas.coordinator.kv_events.stats import REJECT_KINDS, SubscriberStats, view, zeroed
from kvatlas.events import ColumnBatch
from kvatlas.events.vllm_wire import (
    REPLAY_END_SEQ,
    KVEventBatch,
    SplitBatch,
    VllmWireError,
    pack_seq,
    split_batch,
    split_topic,
    unpack_seq,
)
from kvatlas.keys import KeyScheme, check_instance_id, check_wire_model_name

log = logging.getLogger(__name__)

MAX_DP_RANK: Final = 1 << 16
SLICE_PAUSE_S: Final = 0.0005
"""Pause after each applied slice: a thread waiting for the directory lock gets it (a plain
lock is not handed over; released and taken again at once, it would rarely change hands)."""
Ingest = Callable[[Sequence[ColumnBatch]], object]
Clear = Callable[[str], int]


class KvEventsSubscriber:
    def __init__(
        self,
        settings: SubscriberSettings,
        scheme: KeyScheme,
        *,
        ingest: Ingest,
        clear: Clear,
        stop: threading.Event,
        is_node: Callable[[str], bool] = lambda _: False,
    ) -> None:
        self.settings = settings
        self.rekeyer = Rekeyer(scheme, settings.max_blocks)
        self._ingest = ingest
        self._clear = clear
        self._stop = stop
        self._is_node = is_node
        self._links = [Link(spec) for spec in settings.links]
        self._owners: dict[str, str] = {}  # engine instance -> the endpoint that speaks for it
        self._named = {spec.engine: spec.endpoint for spec in settings.links if spec.engine}
        self.counts: Counter[str] = zeroed(SubscriberStats)
        self.engine_ids: frozenset[str] = frozenset()
        """Every engine instance that had a batch applied (kept after ``AllBlocksCleared``: the
        engine still serves) or that the snapshot restored, until the directory forgets it
        (:meth:`forget_engines`); replaced, never mutated, so other threads may read it."""
        self._engines_lock = threading.Lock()  # (writers: this thread, the sweep, the restore)
        self._endpoints = Endpoints(settings, self._links, self.counts)

    def restore_engines(self, engines: frozenset[str]) -> None:
        """Engines a snapshot knew (their cursors restored with it): engines again at once,
        before they publish."""
        with self._engines_lock:
            self.engine_ids = self.engine_ids | engines

    def forget_engines(self, instance_ids: frozenset[str]) -> None:
        """Those the directory forgot (silent beyond ``--emitter-retention-s``) are no engines
        until they publish again."""
        with self._engines_lock:
            self.engine_ids = self.engine_ids - instance_ids

    def is_engine(self, instance_id: str) -> bool:
        """Whether ``instance_id`` is an engine's: one that spoke, or named for an endpoint
        (``ENGINE=ENDPOINT``, with any data-parallel rank)."""
        return instance_id in self.engine_ids or engine_of(instance_id) in self._named

    # ------------------------------------------------------------------ reporting

    def stats(self) -> SubscriberStats:
        rekeyer = self.rekeyer
        return view(
            SubscriberStats, self.counts, rekeyer.counts,
            engines=len(rekeyer.engines), tracked_blocks=rekeyer.total_blocks,
            max_blocks=rekeyer.max_blocks,
        )  # fmt: skip

    # ------------------------------------------------------------------ the loop

    def open(self) -> None:
        """Create the SUB sockets and connect them (a bad endpoint raises ``zmq.ZMQError``
        here, at start-up, not later in the thread)."""
        self._endpoints.open()

    def run(self) -> None:
        self._endpoints.run(self._stop, self.handle)

    def handle(self, link: Link, frames: Sequence[bytes]) -> None:
        """One live message; never raises (a bug is counted as ``errors`` and logged)."""
        try:
            if len(frames) != 3:
                self._reject("frames", f"{len(frames)} frames from {link.endpoint}")
                return
            topic_frame, seq_frame, payload = frames
            try:
                seq = unpack_seq(seq_frame)
                topic = topic_frame.decode("utf-8")
            except (VllmWireError, UnicodeDecodeError) as exc:
                self._reject("frames", f"{link.endpoint}: {exc}")
                return
            self._message(link, topic, seq, payload, live=True)
        except Exception:  # never let one message stop the subscriber
            self.counts["errors"] += 1
            log.exception("kv events: unexpected error on a message from %s", link.endpoint)

    def _message(self, link: Link, topic: str, seq: int, payload: bytes, *, live: bool) -> None:
        last = link.seqs.get(topic)
        if last is not None and seq == last:
            self.counts["duplicates"] += 1
            return
        parsed = self._parse(link, topic, payload)
        if parsed is None:  # counted; a jump before it is still a gap (of unknown instance)
            lost = self._refused_engine(link, topic)
            if lost is not None and last is not None and seq < last:  # a restart all the same
                self._restarted(lost, seq, last)
                last = -1  # (the new incarnation's seqs before this one: missing too)
            jump = seq - last - 1 if last is not None and seq > last + 1 else 0
            if jump:
                self.counts["gaps"] += 1
                self.counts["missing_batches"] += jump
            if lost is not None:  # a batch of an engine it speaks for: lost, a gap at its gate
                self._ingest([self.rekeyer.marker(lost, jump + 1)])
            if last is not None:  # (a refused topic never gets an entry: the map stays bounded)
                link.seqs[topic] = seq
            return
        instance, model, batch = parsed
        link.engine_of[topic] = instance
        if last is not None and seq < last:
            self._restarted(instance, seq, last)
            # The new incarnation counts from 0: what it sent before this (a PUB drops what it
            # sends before the SUB reconnects) is asked of its replay ring, else a gap.
            last = link.seqs[topic] = -1
        if (
            live
            and link.spec.replay is not None
            and seq > (-1 if last is None else last) + 1
            and time.monotonic() >= link.replay_after
        ):
            # Catch up first (the batches before the first one seen count as history, not gap).
            self._replay(link, topic, 0 if last is None else last + 1, seq)
        last = link.seqs.get(topic)
        if last is not None and seq > last + 1:
            missing = seq - last - 1
            self.counts["gaps"] += 1
            self.counts["missing_batches"] += missing
            self._ingest([self.rekeyer.marker(instance, missing)])
            log.warning("kv events: %s lost %d batches (seq %d..%d)", instance, missing,
                        last + 1, seq - 1)  # fmt: skip
        link.seqs[topic] = seq
        self.apply(instance, model, batch)

    def _restarted(self, instance: str, seq: int, last: int) -> None:
        """Engine ``instance``'s seq went back (``seq`` after ``last``): a new incarnation;
        the old one's copies (the dead process's memory) are fenced."""
        self.counts["engine_restarts"] += 1
        log.warning("kv events: %s restarted (seq %d after %d)", instance, seq, last)
        self.rekeyer.restart(instance)
        self._ingest([self.rekeyer.marker(instance)])

    def _emitter(self, link: Link, topic: str) -> tuple[str, str | None]:
        """The engine and model a topic names on this endpoint (``""``: none)."""
        named = link.spec.engine
        if named is not None and topic == "":
            return named, None
        if not topic.startswith(self.settings.topic_prefix):
            return "", None
        return split_topic(topic)

    def _parse(self, link: Link, topic: str, payload: bytes) -> tuple[str, str, SplitBatch] | None:
        emitter, model = self._emitter(link, topic)
        model = model or self.settings.default_model
        try:
            check_instance_id(emitter)
            check_wire_model_name(model or "")
        except ValueError as exc:
            self._reject("topic", f"topic {topic!r:.80}: {exc} (--kv-events-model sets a "
                         "default model)")  # fmt: skip
            return None
        assert model is not None
        named = link.spec.engine
        if named is not None and emitter != named:
            self._reject("foreign", f"{link.endpoint}: topic {topic!r:.80} names {emitter!r}; "
                         f"this endpoint speaks for {named!r}")  # fmt: skip
            return None
        try:
            split = split_batch(payload)
        except VllmWireError as exc:
            self._reject(exc.kind, f"{topic}: {exc.reason}")
            return None
        rank = split.data_parallel_rank
        if rank is not None and not 0 <= rank < MAX_DP_RANK:
            self._reject("invalid", f"{topic}: data_parallel_rank {rank} out of range")
            return None
        instance = engine_instance(emitter, rank)
        return (instance, model, split) if self._may_speak(link, instance) else None

    def _refused_engine(self, link: Link, topic: str) -> str | None:
        """The engine a refused message of ``topic`` came from (its batch could not be read:
        the engine of the topic's last batch read, its data-parallel rank with it)."""
        instance = link.engine_of.get(topic)
        return instance if instance in link.instances else None

    def _may_speak(self, link: Link, instance: str) -> bool:
        """Whether this endpoint may speak for engine ``instance``: not a registered node, not
        another endpoint's engine, not one engine more than its cap (counted when refused)."""
        if instance in link.instances:
            return True
        owner = self._owners.get(instance)
        named = self._named.get(engine_of(instance))  # (with any data-parallel rank)
        if owner is None and named is not None and link.spec.engine is None:
            owner = named  # an engine the operator named for an endpoint is that endpoint's
        if owner is not None:
            why = f"{instance!r} is the engine of {owner}"
        elif self._is_node(instance):
            why = f"{instance!r} is a registered node"
        elif len(link.instances) >= self.settings.max_engines_per_endpoint:
            self._reject("engine_cap", f"{link.endpoint}: {instance!r} would be engine "
                         f"{len(link.instances) + 1} of this endpoint "
                         f"(--kv-events-max-engines-per-endpoint "
                         f"{self.settings.max_engines_per_endpoint})")  # fmt: skip
            return False
        else:
            link.instances.add(instance)
            self._owners[instance] = link.endpoint
            return True
        self._reject("foreign", f"{link.endpoint}: {why}")
        return False

    def apply(self, instance: str, model: str, batch: SplitBatch | KVEventBatch) -> None:
        """One engine batch, in order after the ones before it (a live message's path once
        its seq is followed; the virtual fleet benchmark feeds its engines' batches here)."""
        try:
            ops = self.rekeyer.translate(instance, model, batch)
        except BadBatch as exc:
            self._reject(exc.kind, f"{instance}: {exc}")
            self._ingest([self.rekeyer.marker(instance, 1)])  # a batch lost: a gap at the gate
            return
        if instance not in self.engine_ids:
            with self._engines_lock:
                self.engine_ids = self.engine_ids | {instance}
        # Runs of at most SLICE_ENTRIES entries, one directory call each; a message that
        # needs several pauses between them (the directory lock and the GIL change hands).
        limit, slices = self.rekeyer.slice_entries, 0
        run: list[ColumnBatch] = []
        size = 0
        for op in [*ops, None]:
            if run and (op is None or isinstance(op, Cleared) or size + op.n_entries > limit):
                if slices:
                    time.sleep(SLICE_PAUSE_S)
                if not self._applied(instance, run):
                    return
                slices += 1
                run, size = [], 0
            if isinstance(op, Cleared):
                if not self._applied(instance, op):
                    return
            elif op is not None:
                run.append(op)
                size += op.n_entries
        self.counts["batches"] += 1  # (once all of it is applied)

    def _applied(self, instance: str, run: list[ColumnBatch] | Cleared) -> bool:
        """Apply one slice (or a clear); if it fails, the rest of the batch is lost: their seqs
        are taken, so a marker after them is at once a gap of the engine at the gate (never a
        silent loss)."""
        try:
            if isinstance(run, Cleared):
                self._clear(run.instance_id)
                return True
            self._ingest(run)
        except Exception:
            log.exception("kv events: %s: applying a slice failed; the rest of its batch is a "
                          "gap", instance)  # fmt: skip
            self._ingest([self.rekeyer.marker(instance)])
            self.counts["errors"] += 1  # (after the gap: whoever reads the count sees the gap)
            return False
        self.counts["slices"] += 1
        return True

    def _reject(self, kind: str, message: str) -> None:
        """Count; log the first ten of a kind, then the 16th, 32nd, 64th, ... (a flood of bad
        input must not become a flood of log lines)."""
        assert kind in REJECT_KINDS, kind
        name = f"rejected_{kind}"
        self.counts[name] += 1
        n = self.counts[name]
        if n <= 10 or n & (n - 1) == 0:
            log.warning("kv events: rejected (%s, #%d): %s", kind, n, message)

    # ------------------------------------------------------------------ replay

    def _replay(self, link: Link, topic: str, start: int, end: int) -> None:
        """Ask the publisher's replay socket for ``start``..``end - 1`` and apply them. Other
        engines' batches wait meanwhile: a replay ends at its end marker, a reply's timeout or
        its deadline, whichever comes first (a publisher trickling replies must not stall
        every engine)."""
        replay, settings = link.spec.replay, self.settings
        dealer = self._endpoints.dealer(link)
        dealer.send_multipart([b"", pack_seq(start)])
        deadline = time.monotonic() + settings.replay_deadline
        while (left := deadline - time.monotonic()) > 0 and dealer.poll(
            int(1000 * min(settings.replay_timeout, left))
        ):
            frames = dealer.recv_multipart()
            if frames[:1] == [b""]:
                frames = frames[1:]
            # vLLM's replies: topic, seq, payload; the older ones: seq, payload
            if len(frames) not in (2, 3):
                self._reject("frames", f"replay reply of {len(frames)} frames")
                continue
            try:
                seq = unpack_seq(frames[-2])
                named = frames[0].decode("utf-8") if len(frames) == 3 else topic
            except (VllmWireError, UnicodeDecodeError) as exc:
                self._reject("frames", f"replay: {exc}")
                continue
            if seq == REPLAY_END_SEQ:
                return
            last = link.seqs.get(topic)
            if named != topic:  # a publisher replays its one topic; another one is not ours
                self._reject(
                    "foreign", f"replay from {replay}: topic {named!r:.80}, asked {topic!r:.80}"
                )
            elif start <= seq < end and (last is None or seq > last):
                self.counts["replayed_batches"] += 1
                self._message(link, topic, seq, frames[-1], live=False)
        # No end marker in time: drop the socket so a late reply cannot be taken for the next,
        # and ask again only after a while (a dead replay endpoint must not stall every gap).
        self.counts["replay_failures"] += 1
        log.warning("kv events: replay from %s timed out; gaps stay gaps for %.0f s",
                    replay, settings.replay_backoff)  # fmt: skip
        self._endpoints.drop_dealer(link)
        link.replay_after = time.monotonic() + settings.replay_backoff
