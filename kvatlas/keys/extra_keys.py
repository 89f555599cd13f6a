"""Scheme ``blake3-x1``: chunk hashes that also cover out-of-band identity ("extra keys").

Placeholder substitution needs a span to write into; a LoRA adapter (changes all KV), a
request-level partition or prompt embeddings have none. Under ``blake3-x1`` chunk ``i`` hashes
``H_{i-1} || tokens_i || X1_DOMAIN_TAG || canonical(extra keys of chunk i)``:

* every overlapping multimodal item contributes ``(identifier, offset within the item, start
  in the chunk, overlap length)``, so the same item at another phase is another key;
* request-level keys (e.g. ``lora``) enter chunk 0 only; the chain carries them forward.

Domain separation: a ``blake3`` hash input is always exactly ``32 + 4*C`` bytes, an x1 input is
always longer (the tag is never omitted), so keys of the two schemes can never coincide: old
entries miss, never collide.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvatlas.checks import is_plain_int
from kvatlas.keys.chunk_hash import ChunkSuffix
from kvatlas.keys.mm_substitution import PlaceholderSpan

X1_DOMAIN_TAG = b"\x00kvatlas/blake3-x1\x00"
RequestKeys = Mapping[str, "str | int"]
_NO_REQUEST_KEYS = b"R" + bytes(4)


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal item of a prompt: its identity and its absolute placeholder span."""

    identifier: str
    span: PlaceholderSpan

    @classmethod
    def of(cls, identifier: object, offset: int, length: int) -> MMItem:
        """``None`` is refused: ``str(None)`` would be one identity shared by every unhashed item."""
        if identifier is None:
            raise ValueError("a multimodal item needs an identifier, got None")
        return cls(str(identifier), PlaceholderSpan(offset, length))


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


def encode_request_keys(request_keys: RequestKeys) -> bytes:
    """Sorted by name, typed values: ``{"lora": 7}`` and ``{"lora": "7"}`` are different keys."""
    parts = [b"R", struct.pack(">I", len(request_keys))]
    for name in sorted(request_keys):
        value = request_keys[name]
        if not (isinstance(value, str) or is_plain_int(value)):
            raise ValueError(f"request key {name!r} must be a str or int, got {value!r}")
        parts.append(_text(str(name)))
        parts.append(b"s" + _text(value) if isinstance(value, str) else b"i" + _text(str(value)))
    return b"".join(parts)


def x1_chunk_suffix_fn(
    chunk_size: int, items: Sequence[MMItem], request_keys: RequestKeys | None
) -> ChunkSuffix:
    """Build the per-chunk suffix for a request (items sorted by offset, as in the prompt)."""
    ordered = sorted(items, key=lambda item: (item.span.offset, item.span.length))
    request_part = encode_request_keys(request_keys or {})

    def suffix(chunk_index: int) -> bytes:
        start = chunk_index * chunk_size
        end = start + chunk_size
        overlapping = [it for it in ordered if it.span.offset < end and it.span.end > start]
        parts = [X1_DOMAIN_TAG, request_part if chunk_index == 0 else _NO_REQUEST_KEYS]
        parts.append(b"M" + struct.pack(">I", len(overlapping)))
        for item in overlapping:
            first = max(start, item.span.offset)
            last = min(end, item.span.end)
            parts.append(_text(item.identifier))
            parts.append(struct.pack(">QII", first - item.span.offset, first - start, last - first))
        return b"".join(parts)

    return suffix
