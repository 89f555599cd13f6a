"""Resync route: ``POST /instances/{id}/digest`` — a node sends its inventory digests, the
coordinator answers which buckets differ from its own view of that instance; the node then
lists its placements there in ``resync`` batches (docs/coordinator.md, "Resync").

Body: ``{"tiers": {"l1": {"": "<digest hex>", "ab": "<digest hex>"}, "l2": {...}}}`` — per tier,
digests by prefix: ``""`` (the root: one bucket per first byte of the chunk hash) and one-byte
prefixes (one bucket per second byte). Reply: ``{"instance_id", "tiers": {"l1": ["ab", "cd01",
...]}}``, the child prefixes whose buckets differ, per tier sent.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from kvatlas.api import DigestBody, DigestReply, decode
from kvatlas.coordinator.routes.context import Context
from kvatlas.errors import Unprocessable
from kvatlas.events import TIERS
from kvatlas.events.inventory import BUCKETS, Digest, digest_from_hex
from kvatlas.keys import check_instance_id
from kvatlas.routing import Call


def parse_digests(raw: bytes) -> dict[str, dict[bytes, Digest]]:
    """The body's digests per tier and prefix; :class:`Unprocessable` names what was wrong."""
    body = decode(raw, DigestBody, "digest body")
    out: dict[str, dict[bytes, Digest]] = {}
    for tier, by_prefix in body.tiers.items():
        if tier not in TIERS:
            raise Unprocessable(f"tiers: unknown tier {tier!r:.40}", field="tiers")
        if len(by_prefix) > BUCKETS + 1:
            raise Unprocessable(f"tiers.{tier}: at most {BUCKETS + 1} prefixes", field="tiers")
        digests: dict[bytes, Digest] = {}
        for prefix, text in by_prefix.items():
            try:
                p = bytes.fromhex(prefix)
                if len(p) > 1:
                    raise ValueError("a digest prefix is empty or one byte")
                digests[p] = digest_from_hex(text)
            except ValueError as exc:
                raise Unprocessable(f"tiers.{tier}[{prefix!r:.10}]: {exc}", field="tiers") from None
        out[tier] = digests
    return out


async def digest(ctx: Context, call: Call[None, None]) -> DigestReply:
    instance_id = call.params["instance_id"]
    call.who.require_instance(instance_id)
    try:
        check_instance_id(instance_id)
    except ValueError as exc:
        raise Unprocessable(f"instance_id: {exc}") from None
    theirs = parse_digests(call.raw)
    differ = await run_in_threadpool(ctx.service.compare_digests, instance_id, theirs)
    wire = {tier: [p.hex() for p in prefixes] for tier, prefixes in differ.items()}
    return DigestReply(instance_id=instance_id, tiers=wire)
