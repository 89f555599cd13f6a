"""``POST /route/score`` from body bytes to reply bytes: which instance should serve a query.

Per request, not per instance: **one** blend match (the fragments) and **one** prefix walk
(the query's chunk hashes, looked up in growing windows until no candidate holds the next
chunk); each chunk's placements become one :class:`~kvatlas.coordinator.scoring.Access`, and
:mod:`kvatlas.coordinator.scoring` scores every candidate from those. Runs on the match pool,
never on the event loop. Validation and errors are the blend lookup's (same body fields, same
messages), plus ``instances`` and ``weights``. A registered node that names the engine it
serves (``engine_id``) lends that engine its copies, and is a default candidate as that engine.
The body is JSON (``tokens_b64`` or ``token_ids``) or, with ``Content-Type:
application/msgpack``, :class:`~kvatlas.api.RouteScorePacked` (``tokens`` as little-endian
uint32 bytes: what ``kvatlas router`` sends); the reply is JSON either way. See
docs/route-scoring.md.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.api import RouteScoreBody, RouteScorePacked, RouteScoreRow, RouteScoresReply, decode
from kvatlas.auth import Principal
from kvatlas.coordinator.body_limits import QUERY_ENVELOPE_BYTES
from kvatlas.coordinator.body_size import check_item_count
from kvatlas.coordinator.instances import attachments
from kvatlas.coordinator.query import BlendQuery, blend_query, is_msgpack
from kvatlas.coordinator.scoring import (
    NO_ATTACHMENTS,
    Access,
    Fragment,
    InstanceScore,
    Weights,
    cover_fragments,
    instance_score,
    rank_scores,
    walk_prefix,
)
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.directory import KeyDirectory
from kvatlas.errors import PayloadTooLarge, Unprocessable
from kvatlas.keys import KeyScheme, check_instance_id, pack_kv_rank
from kvatlas.routing import Call, Reply
from kvatlas.web import json_encoder

FIRST_WINDOW = 16
"""Chunks the prefix walk looks up at first; each further window is twice the last."""


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """A validated scoring request; ``query`` is ``None`` for an empty query (nothing to
    reuse: every candidate scores 0)."""

    query: BlendQuery | None
    query_tokens: int
    instances: list[str] | None
    weights: Weights


@functools.lru_cache(maxsize=8)
def _default_weights(fragment: float) -> Weights:
    """The default tier weights (the same immutable value for every call without ``weights``)."""
    return Weights.of(None, fragment)


def route_query(
    body: RouteScoreBody,
    max_tokens: int,
    max_instances: int,
    fragment: float,
    packed: npt.NDArray[np.uint8] | None = None,
) -> RouteQuery:
    """The tokens and namespace as the blend lookup validates them; ``instances`` (valid ids,
    at most ``max_instances``, duplicates dropped) and ``weights`` (known tiers, finite ≥ 0).
    ``packed``: the tokens' little-endian uint32 bytes of a msgpack body (the body then
    carries neither ``tokens_b64`` nor ``token_ids``)."""
    query = blend_query(body, max_tokens, packed)
    instances = body.instances
    if instances is not None:
        if len(instances) > max_instances:
            raise PayloadTooLarge(
                f"{len(instances)} instances exceed --max-instances {max_instances}"
            )
        for i, instance_id in enumerate(instances):
            try:
                check_instance_id(instance_id)
            except ValueError as exc:
                raise Unprocessable(f"instances[{i}]: {exc}") from None
        instances = list(dict.fromkeys(instances))
    try:
        weights = (
            _default_weights(fragment)
            if body.weights is None
            else Weights.of(body.weights, fragment)
        )
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    n = 0 if query is None else len(query.tokens)
    return RouteQuery(query, n, instances, weights)


def score_routes(
    directory: KeyDirectory,
    scheme: KeyScheme,
    query: BlendQuery | None,
    candidates: Sequence[str],
    peers: frozenset[str],
    weights: Weights,
    attached: Mapping[str, str] = NO_ATTACHMENTS,
    plain: frozenset[str] = frozenset(),
) -> list[InstanceScore]:
    """Every candidate's score for ``query``, best first; ``peers`` are the live instances
    whose L1 others may fetch from; ``attached`` maps a node to the engine it serves (its
    copies are that engine's own); ``plain`` candidates reuse no fragment (engines no node
    serves: vLLM reuses a prefix of its own blocks, nothing at another offset, nothing of a
    peer's)."""
    size = directory.chunk_size
    if query is None or not candidates:
        return rank_scores(instance_score(i, (), (), size, weights) for i in candidates)
    tokens, ns = query.tokens, query.namespace
    matches = directory.blend_match(tokens, ns)

    ws = ns.world_size
    ranks = [pack_kv_rank(ws, r, ws, r) for r in range(ws)]  # expand_prefix_keys' ranks

    def access(hashes: Sequence[bytes], reach: frozenset[str] | None) -> list[Access]:
        found = directory.lookup_placements(hashes, ns.model_name, ranks, ns.cache_salt)
        if ws == 1:
            return [Access.one(placements, reach, weights, attached) for placements in found]
        return [
            Access.of(found[c * ws : (c + 1) * ws], reach, weights, attached)
            for c in range(len(hashes))
        ]

    hashes = scheme.chunk_hashes(tokens)

    def prefix_chunks() -> Iterator[Access]:
        start, window = 0, FIRST_WINDOW
        while start < len(hashes):
            yield from access(hashes[start : start + window], None)
            start, window = start + window, 2 * window

    prefix = walk_prefix(candidates, prefix_chunks())
    prefix_tokens = {i: len(classes) * size for i, classes in prefix.items()}
    shortest = min(prefix_tokens.values())
    late = [m for m in matches if m.cur_st >= shortest]  # inside every prefix: no fragment
    distinct = list(dict.fromkeys(m.chunk_hash for m in late))
    by_hash = dict(zip(distinct, access(distinct, peers), strict=True))
    fragments: list[Fragment] = [(m.cur_st, by_hash[m.chunk_hash]) for m in late]
    blending = [i for i in candidates if i not in plain]
    covered = cover_fragments(blending, prefix_tokens, fragments, size, weights)
    return rank_scores(
        instance_score(i, prefix[i], covered.get(i, ()), size, weights) for i in candidates
    )


class RouteScoring:
    """Answers ``POST /route/score`` for ``service`` on ``pool`` (the blend lookup's pool)."""

    def __init__(self, service: CoordinatorService, pool: Executor) -> None:
        self.service = service
        self.pool = pool

    async def handle(self, call: Call[None, None]) -> Reply:
        """The route's handler, answered on the pool. (On the event loop it would save the hop,
        ≈0.17 ms of CPU per call one at a time, but with calls in flight at once the pool
        answers 1.3-1.8× as many per second at the same CPU per call: docs/router.md.)"""
        packed = is_msgpack(call.header(b"content-type"))
        loop = asyncio.get_running_loop()
        return Reply(await loop.run_in_executor(self.pool, self.answer, call.raw, call.who, packed))

    def answer(self, raw: bytes, who: Principal, packed: bool = False) -> bytes:
        """The reply's bytes to body ``raw`` (``packed``: msgpack, else JSON)."""
        started = time.perf_counter()
        config = self.service.config
        if packed:
            body, tokens = decode_packed(raw, config.max_query_tokens, config.max_instances)
        else:
            check_item_count(
                raw, config.max_query_tokens, QUERY_ENVELOPE_BYTES + config.max_instances
            )
            body, tokens = decode(raw, RouteScoreBody), None
        return json_encoder.encode(self.score(body, who, tokens, started))

    def score(
        self,
        body: RouteScoreBody,
        who: Principal,
        packed: npt.NDArray[np.uint8] | None = None,
        started: float | None = None,
    ) -> RouteScoresReply:
        """The reply to a decoded body (``packed``: its tokens' little-endian uint32 bytes,
        as :func:`decode_packed` gives them): what :meth:`answer` encodes, and what a
        process hosting this replica calls directly (``kvatlas router --scores-from
        replica``, docs/router.md)."""
        started = time.perf_counter() if started is None else started
        service = self.service
        config = service.config
        who.require_salts({body.cache_salt})
        asked = route_query(
            body, config.max_query_tokens, config.max_instances, config.fragment_weight, packed
        )
        _, records = service.instances.snapshot()
        # with replicas, also the nodes registered with another one (seen within seconds)
        elsewhere = service.elsewhere
        peers = frozenset(r.instance_id for r in records).union(elsewhere)
        attached = {i: e for i, e in elsewhere.items() if e} | attachments(records)
        engines = service.kv_events.engines()
        if asked.instances is None:  # live instances the caller sees, and every engine
            alive = [v.instance_id for v in service.instances_view(who) if v.alive]
            # a node serving an engine is a candidate as that engine (its copies are the
            # engine's own): the engine is what a router can send the request to
            served = [attached.get(i, i) for i in alive]
            candidates = list(dict.fromkeys([*served, *sorted(engines)]))
        else:
            candidates = asked.instances
        scores = score_routes(
            service.directory,
            service.scheme,
            asked.query,
            candidates,
            peers,
            asked.weights,
            attached,
            engines - set(attached.values()),  # no node, no connector: no fragment reuse
        )
        reply = route_scores_to_wire(scores, asked.query_tokens)
        service.metrics.route_latency.observe(time.perf_counter() - started)
        return reply


_packed_decoder = msgspec.msgpack.Decoder(RouteScorePacked)
_instances_decoder = msgspec.msgpack.Decoder(list[str])
_NIL = b"\xc0"


def decode_packed(
    raw: bytes, max_tokens: int, max_instances: int
) -> tuple[RouteScoreBody, npt.NDArray[np.uint8]]:
    """A msgpack body as the JSON body it stands for (no tokens in it) and its tokens' bytes,
    refused as the JSON body is: 422 naming the field, 413 for more than ``max_tokens``
    tokens or ``max_instances`` instances (read from the array's header, before a string of
    it is made)."""
    try:
        packed = _packed_decoder.decode(raw)
    except msgspec.MsgspecError as exc:
        raise Unprocessable(f"body: {exc}") from None
    tokens = packed.tokens
    if len(tokens) % 4:
        raise Unprocessable(
            f"tokens: {len(tokens)} bytes, not a multiple of 4 (little-endian uint32)"
        )
    if len(tokens) // 4 > max_tokens:
        raise PayloadTooLarge(
            f"query of {len(tokens) // 4} tokens exceeds --max-query-tokens {max_tokens}"
        )
    instances: list[str] | None = None
    listed = bytes(packed.instances)
    if listed and listed != _NIL:
        count = _array_length(listed)
        if count is None:
            raise Unprocessable("body: Expected `array | null` - at `$.instances`")
        if count > max_instances:
            raise PayloadTooLarge(f"{count} instances exceed --max-instances {max_instances}")
        try:
            instances = _instances_decoder.decode(listed)
        except msgspec.MsgspecError as exc:
            raise Unprocessable(f"body: {exc} (in `$.instances`)") from None
    body = RouteScoreBody(
        model_name=packed.model_name,
        world_size=packed.world_size,
        cache_salt=packed.cache_salt,
        instances=instances,
        weights=packed.weights,
    )
    # a writable copy (16 KB for 4k tokens): a read-only view of the body would be a new type
    # for the compiled blend kernels, compiled on the first call instead of at start-up
    return body, np.frombuffer(tokens, dtype=np.uint8).copy()


def _array_length(raw: bytes) -> int | None:
    """The length a msgpack array's header gives (fixarray, array 16, array 32), else
    ``None`` (not an array)."""
    first = raw[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if first == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return None


def route_scores_to_wire(scores: Sequence[InstanceScore], query_tokens: int) -> RouteScoresReply:
    """``POST /route/score``, best first; decoded by ``kvatlas.client.route_client``."""
    return RouteScoresReply(
        instances=[
            RouteScoreRow(
                instance_id=s.instance_id,
                prefix_tokens=s.prefix_tokens,
                fragment_tokens=s.fragment_tokens,
                score=s.score,
                by_tier=s.by_tier,
            )
            for s in scores
        ],
        query_tokens=query_tokens,
    )
