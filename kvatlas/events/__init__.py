"""Cache events: the batch/entry model and its wire codecs (JSON, compact msgpack)."""

from kvatlas.events.errors import EventDecodeError, EventValidationError
from kvatlas.events.json_codec import decode_json, encode_json
from kvatlas.events.model import (
    ACCESS,
    CONFIG,
    DELETE,
    EVENT_TRANSPORTS,
    EVENT_TYPES,
    STORE,
    TIERS,
    UNKNOWN_OFFSET,
    CacheEntry,
    EventBatch,
    readonly_tokens,
)
from kvatlas.events.msgpack_codec import decode_msgpack, encode_msgpack

__all__ = [
    "ACCESS",
    "CONFIG",
    "DELETE",
    "EVENT_TRANSPORTS",
    "EVENT_TYPES",
    "STORE",
    "TIERS",
    "UNKNOWN_OFFSET",
    "CacheEntry",
    "EventBatch",
    "EventDecodeError",
    "EventValidationError",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
    "readonly_tokens",
]
