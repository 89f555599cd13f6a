"""The engines a coordinator knows from KV events, in its snapshot: one section of the snapshot
file (``save_snapshot(..., sections={SECTION: encode_engines(ids)})``), so a restarted
coordinator keeps every engine it knew as an engine — a default route candidate with the
chunks the snapshot restored, an id no node may take, no count against ``--max-instances`` —
before the engine publishes again. Only engines whose cursor the snapshot restored come back:
one the directory forgot (``--emitter-retention-s``) stays forgotten. Versioned: a section this
code does not know is refused, never half-read. See docs/kv-events.md."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from kvatlas.errors import InvalidInput
from kvatlas.keys import check_instance_id

SECTION: Final = "kv_events"
_VERSION: Final = 1


class _State(msgspec.Struct):
    version: int
    engines: list[str]


def encode_engines(engines: Iterable[str]) -> bytes:
    return msgspec.msgpack.encode(_State(_VERSION, sorted(engines)))


def decode_engines(data: bytes) -> frozenset[str]:
    """The section's engine ids (:class:`~kvatlas.errors.InvalidInput` for a section that does
    not decode, or names an id that is not an instance id)."""
    try:
        state = msgspec.msgpack.decode(data, type=_State)
        if state.version != _VERSION:
            raise ValueError(f"kv-events section version {state.version} is not {_VERSION}")
        for engine in state.engines:
            check_instance_id(engine)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise InvalidInput(f"kv-events snapshot section: {exc}") from None
    return frozenset(state.engines)
