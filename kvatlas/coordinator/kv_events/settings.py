"""The subscriber's settings: each endpoint (:class:`LinkSpec`, ``[ENGINE=]ENDPOINT``,
connected or bound, with its replay endpoint), the bounds (engines per endpoint, the largest
message) and an engine's instance id. See docs/kv-events.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvatlas.keys import check_instance_id

BYTES_PER_BLOCK: Final = 256
"""A bound on one block's bytes in a vLLM message (``vllm`` encoding), when every block is an
event of its own (a decode step's): its 32-byte hash and its parent's (34 B each), 16 token ids
of at most 5 B each (80 B) and the event's field names and other values (≈105 B) — ≈254 B."""


DEFAULT_MAX_BLOCKS: Final = 1 << 20
"""``--kv-events-max-blocks``: above every block (GPU + CPU offload) the fleet benchmark's eight
engines hold (``kvatlas bench fleet``); its memory is measured in docs/kv-events.md
("Bounded")."""


MIN_MESSAGE_BYTES: Final = 4096
"""The smallest limit: ZMQ applies it to the handshake too (its READY command carries the
socket type and a routing id of up to 255 bytes)."""


def largest_message_bytes(max_blocks: int) -> int:
    """The default ``--kv-events-max-message-bytes``: a message of ``max_blocks`` blocks (the
    most one batch may hold) of 16 tokens, each block an event of its own."""
    return max(BYTES_PER_BLOCK * max_blocks, MIN_MESSAGE_BYTES)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One endpoint: where, connected or bound, the engine it speaks for (``None``: the ones
    its topics name) and its publisher's replay endpoint."""

    endpoint: str
    replay: str | None = None
    bind: bool = False
    engine: str | None = None

    @classmethod
    def parse(cls, item: str, *, bind: bool = False, replay: str | None = None) -> LinkSpec:
        """``[ENGINE=]ENDPOINT`` (an endpoint has no ``=``); a bad engine id raises
        ``ValueError``."""
        engine, sep, endpoint = item.partition("=")
        if not sep:
            return cls(item, replay, bind)
        check_instance_id(engine)
        return cls(endpoint, replay, bind, engine)


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    links: tuple[LinkSpec, ...]
    topic_prefix: str = "kv@"
    default_model: str | None = None
    max_blocks: int = DEFAULT_MAX_BLOCKS
    replay_timeout: float = 2.0  # the longest wait for one reply of a replay
    replay_deadline: float = 10.0  # the longest one replay takes, however its replies trickle
    replay_backoff: float = 30.0
    max_engines_per_endpoint: int = 1  # engine instances (an engine's dp ranks count apart)
    max_message_bytes: int | None = None  # None: largest_message_bytes(max_blocks)

    @property
    def message_limit_bytes(self) -> int:
        """The largest frame a socket receiving from outside takes (``zmq.MAXMSGSIZE``)."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        return largest_message_bytes(self.max_blocks)


def engine_instance(emitter: str, dp_rank: int | None) -> str:
    """The instance id of an engine: its emitter name, ``:dp<rank>`` added for ranks above 0
    (``@`` cannot be part of an instance id: it separates the topic's fields)."""
    return emitter if not dp_rank else f"{emitter}:dp{dp_rank}"


def engine_of(instance_id: str) -> str:
    """The emitter an engine instance id names (:func:`engine_instance` undone)."""
    return instance_id.split(":dp")[0]
