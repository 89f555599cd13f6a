"""How one event batch body travels as a Redis Streams entry: ``{fmt, data}``.

``data`` is a complete ``POST /events`` body (JSON or msgpack), so the coordinator decodes
stream entries and HTTP bodies with the same codecs and applies them through the same gate.
"""

from __future__ import annotations

from kvatlas.events.errors import EventDecodeError
from kvatlas.events.json_codec import decode_json, encode_json
from kvatlas.events.model import EventBatch
from kvatlas.events.msgpack_codec import decode_msgpack, encode_msgpack

FORMATS = ("msgpack", "json")


def encode_stream_fields(batches: list[EventBatch], fmt: str = "msgpack") -> dict[bytes, bytes]:
    if fmt == "msgpack":
        return {b"fmt": b"msgpack", b"data": encode_msgpack(batches)}
    if fmt == "json":
        return {b"fmt": b"json", b"data": encode_json(batches)}
    raise ValueError(f"unknown stream format {fmt!r}; known: {', '.join(FORMATS)}")


def decode_stream_fields(fields: dict[bytes, bytes]) -> list[EventBatch]:
    fmt = fields.get(b"fmt", b"msgpack")
    data = fields.get(b"data")
    if data is None:
        raise EventDecodeError("data", "stream entry has no 'data' field")
    if fmt == b"msgpack":
        return decode_msgpack(data)
    if fmt == b"json":
        return decode_json(data)
    raise EventDecodeError("fmt", f"unknown stream format {fmt!r:.40}")
