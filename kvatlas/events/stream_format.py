"""How one event batch body travels as a Redis Streams entry: ``{fmt, data}``, signed
``{fmt, data, kid, mac}``.

``data`` is a complete ``POST /events`` body (JSON or msgpack), so the coordinator decodes
stream entries and HTTP bodies with the same codecs and applies them through the same gate.

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

from kvatlas.events.errors import EventDecodeError
from kvatlas.events.json_codec import decode_json, encode_json
from kvatlas.events.model import EventBatch
from kvatlas.events.msgpack_codec import decode_msgpack, encode_msgpack

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
    fmt = fields.get(b"fmt", b"msgpack")
    data = fields.get(b"data")
    if data is None:
        raise EventDecodeError("data", "stream entry has no 'data' field")
    if fmt == b"msgpack":
        return decode_msgpack(data)
    if fmt == b"json":
        return decode_json(data)
    raise EventDecodeError("fmt", f"unknown stream format {fmt!r:.40}")


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
