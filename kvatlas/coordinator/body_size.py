"""Sizing a token query's body from its bytes, before it is decoded: how many token ids and
keys its lists hold and how much else it carries, so that a body holding more than its route
allows is refused (413) before a Python object per token or key exists. Counting reads the
bytes where they lie (no copy of the body); ``query.py`` turns the counts into replies.
See docs/coordinator.md ("Limits") and docs/security.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvatlas.coordinator.body_limits import QUERY_ENVELOPE_BYTES
from kvatlas.errors import PayloadTooLarge

_COUNT_SLICE = 1 << 20


class _LookupShape(msgspec.Struct):
    """A lookup body's fields that may be large, as raw JSON (scanned, not decoded)."""

    keys: msgspec.Raw = msgspec.Raw()
    token_ids: msgspec.Raw = msgspec.Raw()
    tokens_b64: msgspec.Raw = msgspec.Raw()


_lookup_shape_decoder = msgspec.json.Decoder(_LookupShape)


@dataclass(frozen=True, slots=True)
class LookupSize:
    """At most ``tokens`` token ids and ``keys`` keys, and ``other_bytes`` beside them."""

    tokens: int
    keys: int
    other_bytes: int


def lookup_size(raw: bytes) -> LookupSize:
    """The size of a ``POST /directory/lookup`` body; raises ``msgspec.ValidationError``
    when it is not a JSON object, ``msgspec.DecodeError`` when it is not JSON."""
    shape = _lookup_shape_decoder.decode(raw)
    large = len(shape.keys) + len(shape.token_ids) + len(shape.tokens_b64)
    return LookupSize(
        _items(shape.token_ids, ord(",")), _items(shape.keys, ord("{")), len(raw) - large
    )


def _items(raw: msgspec.Raw, separator: int) -> int:
    """At most how many items the JSON array ``raw`` holds: one more than its ``separator``
    bytes (``,`` between token ids, ``{`` opening each key); 0 when it is not an array.
    Counted by ``bytes.count`` a slice at a time (a copy of at most :data:`_COUNT_SLICE`
    bytes), which holds the GIL: numpy's compare of 500 bytes or more releases it."""
    view = memoryview(raw)
    if not len(view) or view[0] != ord("["):
        return 0
    sep = bytes([separator])
    found = sum(
        view[i : i + _COUNT_SLICE].tobytes().count(sep) for i in range(0, len(view), _COUNT_SLICE)
    )
    return found + 1 if separator == ord(",") else found


def check_item_count(raw: bytes, max_tokens: int, beside: int = QUERY_ENVELOPE_BYTES) -> None:
    """Refuse (413) a token-query body that holds more list items than ``max_tokens`` tokens
    and ``beside`` other ones, from its bytes: each item of a JSON list after the first costs
    a comma. Only a body longer than that many bytes is counted (a blend lookup's usual body
    costs nothing)."""
    bound = max_tokens + beside
    if len(raw) > bound and raw.count(b",") > bound:
        raise PayloadTooLarge(f"query holds more than --max-query-tokens {max_tokens} tokens")
