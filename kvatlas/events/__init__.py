"""Cache events: the batch/entry model and its wire codecs (JSON, compact msgpack, and the
Redis Streams entry that carries either).

A batch that exists is valid; a decoder returns every batch of a body or raises
:class:`EventDecodeError` naming the field (docs/directory.md). Importing this package loads no
numba: the JSON token-list parser compiles or loads on its first use.
"""

from kvatlas.api.events import UNKNOWN_OFFSET
from kvatlas.events.columns import ColumnBatch, EntryColumns
from kvatlas.events.errors import EventDecodeError, EventValidationError
from kvatlas.events.json_codec import decode_json, decode_json_columns, encode_json
from kvatlas.events.model import (
    ACCESS,
    CONFIG,
    DELETE,
    ENGINE_TIERS,
    EVENT_TRANSPORTS,
    EVENT_TYPES,
    INT_BOUNDS,
    MAX_ID_CHARS,
    RESYNC,
    STORE,
    TIERS,
    VOLATILE_TIERS,
    CacheEntry,
    EventBatch,
    readonly_tokens,
    tokens_equal,
)
from kvatlas.events.msgpack_codec import decode_msgpack, decode_msgpack_columns, encode_msgpack
from kvatlas.events.stream_format import (
    decode_stream_columns,
    decode_stream_fields,
    encode_stream_fields,
)

__all__ = [
    "ACCESS",
    "CONFIG",
    "DELETE",
    "ENGINE_TIERS",
    "EVENT_TRANSPORTS",
    "EVENT_TYPES",
    "INT_BOUNDS",
    "MAX_ID_CHARS",
    "RESYNC",
    "STORE",
    "TIERS",
    "UNKNOWN_OFFSET",
    "VOLATILE_TIERS",
    "CacheEntry",
    "ColumnBatch",
    "EntryColumns",
    "EventBatch",
    "EventDecodeError",
    "EventValidationError",
    "decode_json",
    "decode_json_columns",
    "decode_msgpack",
    "decode_msgpack_columns",
    "decode_stream_columns",
    "decode_stream_fields",
    "encode_json",
    "encode_msgpack",
    "encode_stream_fields",
    "readonly_tokens",
    "tokens_equal",
]
