"""Request validation: from a request body to the typed query the service answers, or an error
from :mod:`kvatlas.errors` that names what was wrong (422) or which limit was exceeded (413).

Size limits are checked before the expensive step they protect (a base64 text is measured
before it is decoded, a key list before its keys are parsed), so an oversized query costs no
more than reading it. See docs/coordinator.md ("API").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.api import BlendLookupBody, LookupRequest, decode
from kvatlas.auth import Principal
from kvatlas.coordinator._base64 import b64decode_strict, decode_base64
from kvatlas.coordinator.body_limits import KEY_JSON_BYTES, QUERY_ENVELOPE_BYTES
from kvatlas.coordinator.body_size import check_item_count, lookup_size
from kvatlas.errors import Forbidden, PayloadTooLarge, Unprocessable
from kvatlas.events import (
    RESYNC,
    ColumnBatch,
    EventBatch,
    decode_json_columns,
    decode_msgpack_columns,
)
from kvatlas.fields import decode_fields, field_error, field_errors
from kvatlas.keys import (
    BlendNamespace,
    ObjectKey,
    TokenArray,
    as_token_array,
    check_wire_model_name,
    object_keys,
)

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


def is_msgpack(content_type: str | None) -> bool:
    """Whether a body of ``content_type`` is msgpack (else it is read as JSON)."""
    if content_type is None:
        return False
    return content_type.split(";")[0].strip().lower() in MSGPACK_TYPES


# ---------------------------------------------------------------------------- events


def decode_events(body: bytes, content_type: str, max_entries: int) -> list[ColumnBatch]:
    """The batches of a ``POST /events`` body (msgpack or JSON by ``content_type``; store
    entries as columns), all valid and together at most ``max_entries`` entries, or an error
    (nothing is half-decoded)."""
    decode = decode_msgpack_columns if is_msgpack(content_type) else decode_json_columns
    batches = decode(body)  # an EventValidationError is the 422 reply itself (detail + field)
    check_entry_count(batches, max_entries)
    return batches


def check_entry_count(batches: Sequence[ColumnBatch | EventBatch], max_entries: int) -> None:
    """One request (or Redis stream entry) holds at most ``max_entries`` entries (413)."""
    entries = sum(len(b.entries) if isinstance(b, EventBatch) else b.n_entries for b in batches)
    if entries > max_entries:
        raise PayloadTooLarge(f"{entries} entries exceed --max-batch-entries {max_entries}")


def batch_salts(batches: Sequence[ColumnBatch]) -> set[str]:
    """The cache salts of every key the batches carry (an emit token must hold them all)."""
    return set().union(*(b.salts() for b in batches))


def check_emit(who: Principal, batches: Sequence[ColumnBatch]) -> None:
    """``who`` may post every batch: each names one of its instances, every key one of its
    salts (:class:`~kvatlas.errors.Forbidden` otherwise; a refusal for salts lists them all in
    ``cache_salts``, so a node's sink can send its batches again without their entries). One
    rule for ``POST /events`` and signed stream entries (:func:`refused_salts`)."""
    foreign = refused_salts(who, batches)
    if foreign:
        try:
            who.require_salts(foreign, role="emit")
        except Forbidden as exc:
            raise Forbidden(exc.detail, cache_salts=sorted(foreign)) from None


def refused_salts(who: Principal, batches: Sequence[ColumnBatch]) -> frozenset[str]:
    """The cache salts of the batches' keys that ``who`` may not store for (an emit token
    stores only under its own); :class:`~kvatlas.errors.Forbidden` for a batch of an instance
    it may not act for. A signed stream entry is applied without those salts' entries (its
    producer cannot be answered: docs/coordinator.md, "Durability and transports"); a
    ``POST /events`` body is refused (:func:`check_emit`)."""
    for batch in batches:
        who.require_instance(batch.header.instance_id)
    if who.sees_everything:
        return frozenset()
    return frozenset(who.foreign_salts(batch_salts(batches)))


def salt_entries(batches: Sequence[ColumnBatch], salts: frozenset[str]) -> int:
    """How many of the batches' entries (a resync's listing left out) have a key under one
    of ``salts``: the events refused for their salt (``kvatlas_event_refused_entries``)."""
    return sum(
        b.n_entries - b.without_salts(salts).n_entries
        for b in batches
        if b.header.event_type != RESYNC
    )


def b64_too_long(chars: int, max_tokens: int) -> bool:
    """Whether ``chars`` base64 characters hold more than ``max_tokens`` uint32s (whitespace
    included: the check is made before decoding, so it errs on the side of decoding)."""
    return chars // 4 * 3 > 4 * max_tokens + 3


def decode_tokens_b64(text: str, max_tokens: int) -> TokenArray:
    """``tokens_b64`` (strict padded base64 of little-endian uint32) as a token array; the
    length is checked before decoding."""
    if b64_too_long(len(text), max_tokens):  # refuse before decoding
        raise PayloadTooLarge(f"query exceeds --max-query-tokens {max_tokens}")
    raw = b64decode_strict(text)
    if raw is None:
        raise Unprocessable("tokens_b64 is not valid base64")
    return b64_tokens(raw, max_tokens)


def b64_tokens(raw: npt.NDArray[np.uint8], max_tokens: int) -> TokenArray:
    """Decoded ``tokens_b64`` bytes as at most ``max_tokens`` uint32 tokens."""
    if len(raw) % 4:
        raise Unprocessable(f"tokens_b64 decodes to {len(raw)} bytes, not a multiple of 4 (uint32)")
    if len(raw) // 4 > max_tokens:
        raise PayloadTooLarge(
            f"query of {len(raw) // 4} tokens exceeds --max-query-tokens {max_tokens}"
        )
    tokens: TokenArray = raw.view("<u4").astype(np.uint32, copy=False)
    return tokens


def query_tokens(
    token_ids: list[int] | None,
    tokens_b64: str | None,
    max_tokens: int,
    decoded_b64: npt.NDArray[np.uint8] | None = None,
) -> TokenArray:
    """The query tokens of a body that gives ``token_ids`` or ``tokens_b64`` (or neither: no
    tokens), at most ``max_tokens`` of them. ``decoded_b64``: ``tokens_b64`` already decoded
    from the body bytes (:func:`decode_blend_lookup`)."""
    if token_ids is not None and (tokens_b64 is not None or decoded_b64 is not None):
        raise Unprocessable("give token_ids or tokens_b64, not both")
    if decoded_b64 is not None:
        return b64_tokens(decoded_b64, max_tokens)
    if tokens_b64 is not None:
        return decode_tokens_b64(tokens_b64, max_tokens)
    ids = token_ids or []
    if len(ids) > max_tokens:
        raise PayloadTooLarge(f"query of {len(ids)} tokens exceeds --max-query-tokens {max_tokens}")
    try:
        return as_token_array(ids)
    except ValueError as exc:
        raise Unprocessable(f"token_ids: {exc}") from None


# ---------------------------------------------------------------------------- prefix lookup


def check_lookup_size(raw: bytes, max_tokens: int, max_keys: int) -> None:
    """Refuse (413) a ``POST /directory/lookup`` body whose token list or key list is longer
    than its limit, or whose other fields exceed a lookup's envelope, from the body's bytes:
    before a Python object per token or key exists. Malformed JSON is a 422 worded as the
    full decoder would word it."""
    # a first bound at memchr speed: no legitimate lookup holds more commas than this
    check_item_count(raw, max_tokens, QUERY_ENVELOPE_BYTES + max_keys * KEY_JSON_BYTES)
    try:
        size = lookup_size(raw)  # then the fields' own counts (a scan of the body)
    except msgspec.ValidationError as exc:  # not an object: the type's own message
        raise field_errors([field_error(exc, LookupRequest, strict=True)], ("body",)) from None
    except msgspec.DecodeError as exc:
        raise _json_invalid(exc) from None
    if size.other_bytes > QUERY_ENVELOPE_BYTES:  # another field, or a field given twice
        raise PayloadTooLarge(
            f"lookup fields beside keys, token_ids and tokens_b64 exceed {QUERY_ENVELOPE_BYTES} bytes"
        )
    if size.tokens > max_tokens:
        raise PayloadTooLarge(
            f"query of {size.tokens} tokens exceeds --max-query-tokens {max_tokens}"
        )
    if size.keys > max_keys:
        raise PayloadTooLarge(f"{size.keys} keys exceed the query limit")


def _json_invalid(exc: msgspec.DecodeError) -> Unprocessable:
    return field_errors([{"loc": (), "msg": f"JSON decode error: {exc}", "type": "json_invalid"}])


def decode_lookup_body(raw: bytes, max_tokens: int, max_keys: int) -> LookupRequest:
    """``POST /directory/lookup``'s body (called on a worker thread: it may be large), sized
    up from its bytes first (:func:`check_lookup_size`); a 422 names the first bad field
    (:mod:`kvatlas.fields`)."""
    check_lookup_size(raw, max_tokens, max_keys)
    return decode_fields(raw, LookupRequest)


@dataclass(frozen=True, slots=True)
class KeysQuery:
    """``POST /directory/lookup`` by keys."""

    keys: list[ObjectKey]
    form: ClassVar[str] = "keys"

    @property
    def salts(self) -> set[str]:
        return {k.cache_salt for k in self.keys}


@dataclass(frozen=True, slots=True)
class TokensQuery:
    """``POST /directory/lookup`` by tokens: the prefix chunks of ``tokens`` in a namespace."""

    tokens: TokenArray
    model_name: str
    world_size: int
    cache_salt: str
    object_group_id: int
    form: ClassVar[str] = "tokens"

    @property
    def salts(self) -> set[str]:
        return {self.cache_salt}


def lookup_query(body: LookupRequest, max_tokens: int, max_keys: int) -> KeysQuery | TokensQuery:
    """Exactly one form: ``keys``, or ``token_ids``/``tokens_b64`` with ``model_name``; at
    most ``max_keys`` keys or ``max_tokens`` tokens. An empty list beside the other form is LMCache's
    default for the form not used: absent."""
    keys, token_ids = body.keys, body.token_ids
    if keys == [] and (token_ids or body.tokens_b64 is not None):
        keys = None
    if token_ids == [] and keys:
        token_ids = None
    token_form = token_ids is not None or body.tokens_b64 is not None
    if (keys is not None) == token_form:
        raise Unprocessable("give exactly one form: keys, or token_ids/tokens_b64 with model_name")
    if keys is not None:
        if len(keys) > max_keys:
            raise PayloadTooLarge(f"{len(keys)} keys exceed the query limit")
        try:  # (the rows' fields are the ones ObjectKey.from_wire reads, typed: no dict each)
            for model_name in {k.model_name for k in keys}:
                check_wire_model_name(model_name)
            return KeysQuery(
                object_keys(
                    [k.chunk_hash_hex for k in keys],
                    [(k.model_name, k.kv_rank, k.object_group_id, k.cache_salt) for k in keys],
                )
            )
        except ValueError as exc:
            raise Unprocessable(f"keys: {exc}") from None
    tokens = query_tokens(token_ids, body.tokens_b64, max_tokens)
    if not body.model_name:
        raise Unprocessable("model_name is required with token_ids")
    try:
        check_wire_model_name(body.model_name)
        BlendNamespace(body.model_name, body.cache_salt, body.world_size)
        if body.object_group_id < 0:
            raise ValueError("object_group_id must be >= 0")
        if body.object_group_id >> 64:
            raise ValueError("object_group_id must be < 2^64")
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    return TokensQuery(
        tokens, body.model_name, body.world_size, body.cache_salt, body.object_group_id
    )


# ---------------------------------------------------------------------------- blend lookup


def decode_blend_body(raw: bytes) -> BlendLookupBody:
    """The blend-lookup body, decoded straight from bytes (the hot path: no dict, no model),
    or a 422 naming the field."""
    return decode(raw, BlendLookupBody)


# The blend-lookup body with ``tokens_b64`` as raw JSON (msgspec.Raw): tells whether a body
# without its first ``tokens_b64`` member holds another one.
_BlendLookupWire = msgspec.defstruct(
    "BlendLookupWire",
    [
        (f.name, msgspec.Raw, msgspec.Raw())
        if f.name == "tokens_b64"
        else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(BlendLookupBody)
    ],
)
_blend_wire_decoder = msgspec.json.Decoder(_BlendLookupWire)
_OTHER_FIELDS = tuple(n for n in BlendLookupBody.__struct_fields__ if n != "tokens_b64")
_TOKENS_B64_KEY = b'"tokens_b64"'
_JSON_SPACE = b" \t\r\n"


def decode_blend_lookup(
    raw: bytes, max_tokens: int
) -> tuple[BlendLookupBody, npt.NDArray[np.uint8] | None]:
    """:func:`decode_blend_body`, and the bytes of its ``tokens_b64`` when they were decoded
    straight from ``raw`` (the body's ``tokens_b64`` is then ``None``): the hot path of a blend
    lookup. A 32k-token query is 175 KB of base64; the JSON decoder would scan it and
    copy it into a ``str`` only for the base64 kernel to read it again. Here the kernel reads it
    where it lies and the decoder sees the rest of the body. Done for a top-level
    ``"tokens_b64": "<valid base64 within the limit>"`` given once; anything else (escapes,
    whitespace, another type, invalid base64, too long, the key twice, malformed JSON) takes
    :func:`decode_blend_body`'s path, so every reply, error or not, is the same as there.
    A body of more list items than the query may hold is refused first
    (:func:`check_item_count`)."""
    check_item_count(raw, max_tokens)
    split = _split_tokens_b64(raw, max_tokens)
    if split is not None:
        rest, decoded = split
        wire = _decode_wire(rest)
        if wire is not None and not len(wire.tokens_b64):
            fields = {name: getattr(wire, name) for name in _OTHER_FIELDS}
            return BlendLookupBody(**fields), decoded
    return decode_blend_body(raw), None


def _decode_wire(raw: bytes) -> Any:
    try:
        return _blend_wire_decoder.decode(raw)
    except msgspec.MsgspecError:
        return None


def _split_tokens_b64(raw: bytes, max_tokens: int) -> tuple[bytes, npt.NDArray[np.uint8]] | None:
    """The body without the member at the first ``"tokens_b64"`` of ``raw``, and that member's
    string decoded; ``None`` unless the key is a member of the top-level object (the members
    before it are an object of their own), its value a string of valid base64 (so without
    escapes) and what follows it completes the object. The caller checks that the rest holds
    no other ``tokens_b64``."""
    key = raw.find(_TOKENS_B64_KEY)
    if key < 0:
        return None
    head = raw[:key].strip(_JSON_SPACE)  # "{" or "{<members>,"
    if head == b"{":
        members = b""
    elif head[:1] == b"{" and head[-1:] == b"," and head[1:-1].strip(_JSON_SPACE):
        members = head[1:-1]  # must be an object's members of their own: the key is then at
        if _decode_wire(b"{" + members + b"}") is None:  # the top level, not inside a string
            return None
    else:
        return None
    colon = _skip_space(raw, key + len(_TOKENS_B64_KEY))
    start = _skip_space(raw, colon + 1) + 1
    if raw[colon : colon + 1] != b":" or raw[start - 1 : start] != b'"':
        return None
    end = raw.find(b'"', start)
    if end < 0 or b64_too_long(end - start, max_tokens):
        return None
    decoded = decode_base64(memoryview(raw)[start:end])
    if decoded is None:
        return None
    tail = raw[end + 1 :].lstrip(_JSON_SPACE)  # "}" or ",<members>}"
    if tail[:1] == b"}":
        return b"{" + members + tail, decoded
    if tail[:1] != b"," or tail[1:].lstrip(_JSON_SPACE)[:1] == b"}":
        return None
    return b"{" + members + (b"," if members else b"") + tail[1:], decoded


def _skip_space(raw: bytes, i: int) -> int:
    while raw[i : i + 1] in (b" ", b"\t", b"\r", b"\n"):
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class BlendQuery:
    """Fragments of ``tokens`` to find in ``namespace``."""

    tokens: TokenArray
    namespace: BlendNamespace


def blend_query(
    body: BlendLookupBody, max_tokens: int, decoded_b64: npt.NDArray[np.uint8] | None = None
) -> BlendQuery | None:
    """The query of a blend-lookup body; ``None`` for an empty query (nothing to match)."""
    tokens = query_tokens(body.token_ids, body.tokens_b64, max_tokens, decoded_b64)
    if not len(tokens):
        return None
    if not body.model_name:
        raise Unprocessable("model_name is required with non-empty tokens")
    try:
        check_wire_model_name(body.model_name)
        namespace = BlendNamespace(body.model_name, body.cache_salt, body.world_size)
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    return BlendQuery(tokens, namespace)
