"""Decoding and encoding of the wire types: one decoder per type, made on first use, and one
encoder. A body or reply that is not of its type is refused whole with
:class:`~kvatlas.errors.Unprocessable` naming where (``what``) and what was wrong (msgspec's
message: the field path and the expected type or constraint), never half-read."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvatlas.errors import Unprocessable

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def decoder(type_: type[T]) -> msgspec.json.Decoder[T]:
    """The JSON decoder of ``type_`` (made once, then shared: decoders are thread-safe)."""
    found = _decoders.get(type_)
    if found is None:
        found = _decoders[type_] = msgspec.json.Decoder(type_)
    return found


def decode(raw: bytes | str, type_: type[T], what: str = "body") -> T:
    """``raw`` JSON as a ``type_``, or :class:`Unprocessable` ``"<what>: <why>"``."""
    try:
        return decoder(type_).decode(raw)
    except msgspec.MsgspecError as exc:
        raise Unprocessable(f"{what}: {exc}") from None


def encode(value: Any) -> bytes:
    """A wire value (a Struct, or plain JSON values) as JSON bytes."""
    return _encoder.encode(value)


S = TypeVar("S", bound=msgspec.Struct)


def from_attributes(type_: type[S], value: object, **given: Any) -> S:
    """A ``type_`` whose fields are ``value``'s attributes of the same names (a domain value and
    its wire row name a field alike), ``given`` for the others; a field neither has keeps its
    default. What builds a reply from a service's value without restating each field, once per
    request: rows built per item (placements, scores) are written with keywords, which is
    several times cheaper."""
    names = type_.__struct_fields__
    found = {f: getattr(value, f) for f in names if f not in given and hasattr(value, f)}
    return type_(**found, **given)


class ErrorReply(msgspec.Struct):
    """Any refusal's body (``kvatlas.web.error_payload``): its ``detail`` and, for an event
    that broke a rule, the ``field`` path (``batches[i]...``); for a prefetch whose instance
    could not be reached (502), the ``request_id`` of the command kept for retry; for events
    refused for their keys' salts (403), every such salt (``cache_salts``). Other fields an
    error carries are ignored."""

    detail: Any = None
    field: str | None = None
    request_id: str | None = None
    cache_salts: list[str] | None = None
