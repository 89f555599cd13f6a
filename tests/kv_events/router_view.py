"""A router's view of published KV events, built the way a router builds it: a plain pyzmq SUB
socket, a DEALER for replay and untyped msgspec decoding (not kvatlas's decoder)."""

from __future__ import annotations

import struct
from collections import defaultdict
from typing import Any

import msgspec
import zmq

State = dict[str, dict[str, set[bytes]]]  # topic -> medium -> block hashes


_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event_map(event: list[Any]) -> dict[str, Any]:
    """An array-encoded event (``[tag, field, ...]``) as the map a router's code reads."""
    names = _ARRAY_FIELDS[event[0]]
    return {"type": event[0], **dict(zip(names, event[1:], strict=False))}


class RouterView:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str, replay: str | None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.dealer = None
        if replay is not None:
            self.dealer = ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.connect(replay)
        self.pending: dict[int, tuple[str, bytes]] = {}
        self.next_seq = 0
        self.state: defaultdict[str, defaultdict[str, set[bytes]]] = defaultdict(
            lambda: defaultdict(set)
        )
        self.token_ids: dict[bytes, list[int]] = {}
        self.block_sizes: set[int] = set()
        self.encodings: set[str] = set()

    def replay(self) -> None:
        """Ask for everything from the next seq this view needs (vLLM's replay answers
        ``topic, seq, payload``; the older one ``seq, payload``, the payload naming its topic)."""
        assert self.dealer is not None
        self.dealer.send_multipart([b"", struct.pack(">q", self.next_seq)])
        while True:
            assert self.dealer.poll(5000), "no replay answer"
            frames = self.dealer.recv_multipart()[1:]
            topic = frames[0].decode() if len(frames) == 3 else ""
            seq = struct.unpack(">q", frames[-2])[0]
            if seq == -1:
                break
            self.pending.setdefault(seq, (topic, frames[-1]))

    def pump(self) -> State:
        """Take what arrived, apply it in seq order, and return the view."""
        while self.sub.poll(0):
            topic, seq_frame, payload = self.sub.recv_multipart()
            self.pending[struct.unpack(">q", seq_frame)[0]] = (topic.decode(), payload)
        if self.pending and self.next_seq not in self.pending and self.dealer is not None:
            self.replay()
        while self.next_seq in self.pending:
            topic, payload = self.pending.pop(self.next_seq)
            self._apply(topic, payload)
            self.next_seq += 1
        return self.view()

    def _apply(self, topic: str, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        if isinstance(batch, list) and all(isinstance(e, dict) for e in batch[1]):
            self.encodings.add("vllm")  # [ts, events as maps, dp rank]
            batch = {"events": batch[1]}
        elif isinstance(batch, list):  # the older encoding: [ts, events, dp rank, topic]
            self.encodings.add("array")
            batch = {"events": [_event_map(e) for e in batch[1]], "kvatlas_topic": batch[3]}
        else:
            self.encodings.add("map")
        topic = topic or batch["kvatlas_topic"]  # a replayed message: its payload names it
        for event in batch["events"]:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self.state.pop(topic, None)
            elif kind == "BlockStored":
                self.state[topic][event["medium"]].update(event["block_hashes"])
                self.block_sizes.add(event["block_size"])
                tokens, size = event["token_ids"], event["block_size"]
                for i, h in enumerate(event["block_hashes"] if tokens else ()):
                    self.token_ids[h] = tokens[i * size : (i + 1) * size]
            elif kind == "BlockRemoved":
                self.state[topic][event["medium"]].difference_update(event["block_hashes"])

    def view(self) -> State:
        return {
            t: {m: set(hs) for m, hs in media.items() if hs}
            for t, media in self.state.items()
            if any(media.values())
        }

    def close(self) -> None:
        self.sub.close(0)
        if self.dealer is not None:
            self.dealer.close(0)
