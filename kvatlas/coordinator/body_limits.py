"""Body limits: the largest legitimate body of each kind of coordinator route, in bytes, from
the configured limits (``--max-query-tokens``, ``--max-batch-entries``, ``--chunk-size``,
``--max-instances``, capped by ``--max-body-bytes``). See docs/coordinator.md ("Limits")."""

from __future__ import annotations

from dataclasses import dataclass

from kvatlas.events import TIERS
from kvatlas.events.inventory import BUCKETS, DIGEST_BYTES
from kvatlas.keys.object_key import MAX_INSTANCE_ID_CHARS

QUERY_ENVELOPE_BYTES = 64 * 1024
"""A lookup body's JSON beside its tokens: field names, model name, salt, whitespace."""
ENTRY_ENVELOPE_BYTES = 768
"""One event entry's JSON beside its token ids: the key (64 hex digits, a model name of up to
256 and a salt of up to 128 characters, ``kv_rank``, group), size, offset, field names. A model
name may be longer (up to ``MAX_MODEL_NAME_CHARS``): a batch of such entries reaches the
route's limit with fewer entries (413 at the largest batches)."""
KEY_JSON_BYTES = ENTRY_ENVELOPE_BYTES
"""One key of a keys-form lookup in JSON, at most (the key part of an entry's envelope)."""
TOKEN_JSON_BYTES = 11
"""One token id in a JSON list at worst: ten digits and a comma."""
INSTANCE_ID_JSON_BYTES = 4 + MAX_INSTANCE_ID_CHARS
"""One instance id in a JSON list: the id, its quotes, a comma and a space."""
REGISTRATION_BODY_BYTES = 64 * 1024
"""``POST /instances``: the registration fields (16 KiB of metadata, a few short strings)."""
SMALL_BODY_BYTES = 4096
"""Routes whose body is a field or two (heartbeat, deregister, chunk size, a node's value
report) or none at all."""


def token_query_bytes(max_tokens: int) -> int:
    """The largest body naming ``max_tokens`` tokens: as JSON ids (11 bytes each at worst)
    or as ``tokens_b64`` (4 base64 characters per 3 bytes of uint32s), plus the envelope."""
    ids = TOKEN_JSON_BYTES * max_tokens
    b64 = 4 * -(-4 * max_tokens // 3)
    return max(ids, b64) + QUERY_ENVELOPE_BYTES


def events_body_bytes(max_batch_entries: int, chunk_size: int) -> int:
    """The largest ``POST /events`` body: ``max_batch_entries`` token-bearing entries of
    ``chunk_size`` tokens, in JSON (msgpack is smaller)."""
    return max_batch_entries * (ENTRY_ENVELOPE_BYTES + TOKEN_JSON_BYTES * chunk_size)


def largest_request_bytes(max_query_tokens: int, max_batch_entries: int, chunk_size: int) -> int:
    """The default ``--max-body-bytes``: the larger of a full-context lookup (``tokens_b64`` of
    ``max_query_tokens`` uint32s: 4 base64 characters per 3 bytes) and a full ``POST /events``
    body (``max_batch_entries`` token-bearing entries of ``chunk_size`` tokens, in JSON).
    Each route has its own, smaller limit (:class:`RouteBodies`); this one caps them all.
    Documented in docs/coordinator.md ("Limits")."""
    query = 4 * -(-4 * max_query_tokens // 3) + QUERY_ENVELOPE_BYTES
    return max(query, events_body_bytes(max_batch_entries, chunk_size))


@dataclass(frozen=True, slots=True)
class RouteBodies:
    """The largest legitimate body of each kind of coordinator route, in bytes, derived from
    the limits of the route itself (``--max-query-tokens``, ``--max-batch-entries``,
    ``--chunk-size``, ``--max-instances``) and capped by ``--max-body-bytes`` when given. The
    route table (``routes.ROUTES``) names which one each route takes."""

    events: int
    lookup: int
    blend_lookup: int
    route_score: int
    digest: int
    registration: int
    small: int

    @classmethod
    def of(
        cls,
        *,
        max_query_tokens: int,
        max_lookup_keys: int,
        max_instances: int,
        max_batch_entries: int,
        chunk_size: int,
        max_body_bytes: int | None,
    ) -> RouteBodies:
        query = token_query_bytes(max_query_tokens)
        keys = max_lookup_keys * KEY_JSON_BYTES + QUERY_ENVELOPE_BYTES
        instances = max_instances * INSTANCE_ID_JSON_BYTES
        digests = len(TIERS) * (BUCKETS + 1) * (2 * DIGEST_BYTES + 16) + 1024
        sizes = {
            "events": events_body_bytes(max_batch_entries, chunk_size),
            "lookup": max(query, keys),
            "blend_lookup": query,
            "route_score": query + instances,
            "digest": digests,
            "registration": REGISTRATION_BODY_BYTES,
            "small": SMALL_BODY_BYTES,
        }
        cap = max_body_bytes
        return cls(**{k: v if cap is None else min(v, cap) for k, v in sizes.items()})
