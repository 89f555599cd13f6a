"""The engine's KV events on ZMQ, as vLLM 0.33's ``ZmqEventPublisher`` sends them.

Frames ``[topic, seq (8-byte big-endian), payload]`` on a PUB socket, the payload a
``KVEventBatch`` in vLLM's own encoding (:func:`kvatlas.events.vllm_wire.encode_batch`), with
``data_parallel_rank`` 0 as vLLM stamps it. The PUB endpoint is bound when it has a wildcard
(``*``, ``::``) or is ``ipc://``/``inproc://``, and connected otherwise; the replay ROUTER always
binds. A replay request ``[client, b"", start seq]`` is answered with ``[client, b"", topic,
seq, payload]`` for every kept batch from that seq on, then ``[client, b"", b"", -1, b""]``.
One thread owns both sockets (ZMQ sockets are not thread-safe); batches wait in a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from kvatlas.events.vllm_wire import (
    REPLAY_END_SEQ,
    KVEvent,
    KVEventBatch,
    encode_batch,
    pack_seq,
)

log = logging.getLogger(__name__)


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer_steps: int = 10_000) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.sent = 0
        self._queue: queue.SimpleQueue[list[KVEvent] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        """Open the sockets in the publisher's thread; raises here if they cannot be opened."""
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def publish(self, events: list[KVEvent]) -> None:
        if events:
            self._queue.put(events)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        replay: Any = None
        try:
            if is_bind_endpoint(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(0)
            ctx.term()
            return
        self._ready.set()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                seq = self._seq
                self._seq += 1
                payload = encode_batch(KVEventBatch(time.time(), item, 0))
                pub.send_multipart([self.topic, pack_seq(seq), payload])
                self._buffer.append((seq, payload))
                self.sent += 1
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(0)
            ctx.term()

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request: %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart([client, b"", self.topic, pack_seq(seq), payload])
        replay.send_multipart([client, b"", b"", pack_seq(REPLAY_END_SEQ), b""])
