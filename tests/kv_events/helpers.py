"""Golden vLLM payloads and a directory fed the way the coordinator feeds it (no ZMQ)."""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvatlas.coordinator.kv_events import (
    Cleared,
    KvEventsSubscriber,
    LinkSpec,
    Rekeyer,
    SubscriberSettings,
)
from kvatlas.directory import KeyDirectory
from kvatlas.events.vllm_wire import KVEventBatch, decode_batch, pack_seq, unpack_seq
from kvatlas.keys import KeyScheme
from tests.conftest import wait_for

GOLDEN = Path("/work/shared/wire/vllm-kv-events")
CASES = json.loads((GOLDEN / "index.json").read_text())["cases"]
HASHES = [bytes.fromhex(h) for h in CASES[0]["block_hashes_hex"]]
TOKENS = list(range(1000, 1064))

# An unknown tag, then a string that is not UTF-8: the typed decoder stops at the tag, the
# untyped one that tells an unknown tag from an invalid field at the string.
UNKNOWN_TAG_THEN_BAD_UTF8 = (
    b"\x93" + msgspec.msgpack.encode(1.0)
    + b"\x92" + msgspec.msgpack.encode({"type": "Bogus"}) + b"\x81\xa4type\xa2\xff\xfe"
    + b"\xc0"
)  # fmt: skip
# Arrays nested deeper than msgspec follows (it raises RecursionError)
NESTED_TOO_DEEP = b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" * 100_001 + b"\xc0" + b"\xc0"


def golden(name: str) -> bytes:
    return (GOLDEN / f"{name}.msgpack").read_bytes()


def golden_batch(name: str) -> KVEventBatch:
    return decode_batch(golden(name))


def apply(rekeyer: Rekeyer, directory: KeyDirectory, instance: str, model: str,
          batch: KVEventBatch) -> None:  # fmt: skip
    """What the subscriber does with a translated batch."""
    for op in rekeyer.translate(instance, model, batch):
        if isinstance(op, Cleared):
            directory.fence_instance(op.instance_id)
        else:
            directory.apply_columns([op])


def fed(scheme: str = "blake3", chunk_size: int = 32, max_blocks: int = 1000,
        *, blend: bool = False) -> tuple[Rekeyer, KeyDirectory]:  # fmt: skip
    ks = KeyScheme(scheme, chunk_size)
    directory = KeyDirectory(
        chunk_size, enable_blend_lookup=blend,
        hash_chunks=lambda tokens, _size: ks.chunk_hashes(tokens),
    )  # fmt: skip
    return Rekeyer(ks, max_blocks), directory


class FakeEngine:
    """A vLLM-like publisher on loopback: PUB with ``[topic, seq, payload]`` frames and a
    ROUTER replay socket served by its own thread (the engine side is the only mock)."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        rport = router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.ring: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.requests: list[int] = []
        self.thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
        self.thread.start()

    def record(self, seq: int, payload: bytes) -> None:
        """Into the replay ring only (a batch the subscriber missed)."""
        with self.lock:
            self.ring.append((seq, payload))

    def send(self, seq: int, payload: bytes, topic: str = "kv@pod-a@llama") -> None:
        self.record(seq, payload)
        self.pub.send_multipart([topic.encode(), pack_seq(seq), payload])

    def send_until(self, seq: int, payload: bytes, seen: Callable[[], bool],
                   topic: str = "kv@pod-a@llama") -> None:  # fmt: skip
        """Re-send (same seq: the subscriber drops repeats) until ``seen`` (slow joiners)."""
        self.record(seq, payload)
        for _ in range(600):
            self.pub.send_multipart([topic.encode(), pack_seq(seq), payload])
            if wait_for(seen, timeout=0.1):
                return
        raise AssertionError(f"seq {seq} never seen")

    def _serve(self, router: Any) -> None:
        while not self.stop.is_set():
            if not router.poll(20):
                continue
            identity, _, start = router.recv_multipart()
            self.requests.append(unpack_seq(start))
            with self.lock:
                ring = list(self.ring)
            for seq, payload in ring:
                if seq >= unpack_seq(start):
                    router.send_multipart([identity, b"", pack_seq(seq), payload])
            router.send_multipart([identity, b"", pack_seq(-1), b""])
        router.close(0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close(0)
        self.ctx.term()


class Subscribed:
    """A subscriber thread feeding a directory through the coordinator's two calls."""

    def __init__(self, endpoints: list[str], replay: list[str | None], chunk_size: int = 16,
                 scheme: str = "blake3", max_blocks: int = 1000,
                 replay_timeout: float = 2.0) -> None:  # fmt: skip
        _, self.directory = fed(scheme, chunk_size)
        directory = self.directory
        self.stop = threading.Event()
        links = tuple(LinkSpec(e, r) for e, r in zip(endpoints, replay, strict=True))
        settings = SubscriberSettings(links, max_blocks=max_blocks, replay_timeout=replay_timeout)
        self.sub = KvEventsSubscriber(
            settings, KeyScheme(scheme, chunk_size),
            ingest=directory.apply_columns,
            clear=directory.fence_instance, stop=self.stop,
        )  # fmt: skip
        self.thread = threading.Thread(target=self.sub.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()
