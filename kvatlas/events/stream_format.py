"""How one event batch body travels as a Redis Streams entry: ``{fmt, data}``, signed
``{fmt, data, kid, mac}``.

``data`` is a complete ``POST /events`` body (JSON or msgpack), so the coordinator decodes
stream entries and HTTP bodies with the same codecs (:func:`decode_stream_columns`: into
columns, as ``POST /events`` bodies are, no object per entry) and applies them through the
same gate.

The stream carries no bearer token, so a node signs each entry with a key derived from its
coordinator token (:func:`kvatlas.auth.stream_key`): ``kid`` names the key, ``mac`` is a keyed
BLAKE3 of the stream name, the key id, the format and the data (each of the first four
length-prefixed). A coordinator with auth on applies an entry only as the principal whose key
verifies it (docs/security.md, "Redis transport"): whoever can ``XADD`` cannot speak for a
node whose token it does not hold, and an entry moved to another stream no longer verifies.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import blake3

from kvatlas.events.columns import ColumnBatch
from kvatlas.events.errors import EventDecodeError
from kvatlas.events.json_codec import decode_json, decode_json_columns, encode_json
from kvatlas.events.model import EventBatch
from kvatlas.events.msgpack_codec import decode_msgpack, decode_msgpack_columns, encode_msgpack

FORMATS = ("msgpack", "json")
KEY_ID_FIELD = b"kid"
MAC_FIELD = b"mac"
_MAC_DOMAIN = b"kvatlas-stream-entry-v1"


def encode_stream_fields(batches: list[EventBatch], fmt: str = "msgpack") -> dict[bytes, bytes]:
    if fmt == "msgpack":
        return {b"fmt": b"msgpack", b"data": encode_msgpack(batches)}
    if fmt == "json":
        return {b"fmt": b"json", b"data": encode_json(batches)}
    raise ValueError(f"unknown stream format {fmt!r}; known: {', '.join(FORMATS)}")


def decode_stream_fields(fields: Mapping[bytes, bytes]) -> list[EventBatch]:
    """An entry's batches as objects (tests, tools; the coordinator decodes columns)."""
    fmt, data = _format_and_data(fields)
    return decode_msgpack(data) if fmt == b"msgpack" else decode_json(data)


def decode_stream_columns(fields: Mapping[bytes, bytes]) -> list[ColumnBatch]:
    """An entry's batches with their entries as columns (a resync's as objects): the batches
    and the errors of :func:`decode_stream_fields`, without an object per entry."""
    fmt, data = _format_and_data(fields)
    return decode_msgpack_columns(data) if fmt == b"msgpack" else decode_json_columns(data)


def _format_and_data(fields: Mapping[bytes, bytes]) -> tuple[bytes, bytes]:
    """The entry's format (``msgpack`` when absent) and body, or the error naming the field."""
    fmt = fields.get(b"fmt", b"msgpack")
    data = fields.get(b"data")
    if data is None:
        raise EventDecodeError("data", "stream entry has no 'data' field")
    if fmt not in (b"msgpack", b"json"):
        raise EventDecodeError("fmt", f"unknown stream format {fmt!r:.40}")
    return fmt, data


def entry_mac(fields: Mapping[bytes, bytes], stream: str, key_id: bytes, secret: bytes) -> bytes:
    """The hex MAC of an entry's ``fmt`` and ``data`` on ``stream`` under ``secret``."""
    mac = blake3.blake3(key=secret)
    for part in (_MAC_DOMAIN, stream.encode(), key_id, fields.get(b"fmt", b"msgpack")):
        mac.update(len(part).to_bytes(4, "big") + part)
    mac.update(fields.get(b"data", b""))
    return mac.hexdigest().encode()


def sign_stream_fields(
    fields: Mapping[bytes, bytes], stream: str, key_id: bytes, secret: bytes
) -> dict[bytes, bytes]:
    """``fields`` with the key id and MAC of the key ``(key_id, secret)`` for ``stream``."""
    mac = entry_mac(fields, stream, key_id, secret)
    return {**fields, KEY_ID_FIELD: key_id, MAC_FIELD: mac}


def signing_key_id(fields: Mapping[bytes, bytes]) -> bytes | None:
    """The key id an entry claims to be signed with (``None``: unsigned)."""
    if MAC_FIELD not in fields:
        return None
    return fields.get(KEY_ID_FIELD)


def mac_valid(fields: Mapping[bytes, bytes], stream: str, key_id: bytes, secret: bytes) -> bool:
    """Whether the entry's MAC is the one ``secret`` gives on ``stream`` (constant time)."""
    sent = fields.get(MAC_FIELD, b"")
    return hmac.compare_digest(sent, entry_mac(fields, stream, key_id, secret))
