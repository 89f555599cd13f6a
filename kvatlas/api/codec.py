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
