"""The node's cache control: the operations behind the MP-server routes (``DELETE /cache/objects``,
``POST /cache/prefetches``, ``GET /cache/prefetches/{request_id}``, ``GET /cache/objects``,
``POST /cache/clear``), with LMCache 0.5.6's shapes and status codes (:mod:`kvatlas.api.
cache_control`), so that either coordinator can drive either kind of server.

Validation comes before any change: a request that is refused (400 a bad key or too many, 404 an
L2 backend this node does not have, 503 a model this node does not serve) removes and loads
nothing. A prefetch's status is kept for ``status_ttl_s`` after it completes and polls do not
consume it (LMCache forgets a job at its first completed poll: a poll whose reply is lost then
finds nothing); at most ``max_jobs`` are kept, the oldest completed first. See
``docs/cache-control.md``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

from kvatlas.api.cache_control import (
    MAX_DELETE_KEYS,
    ClearBody,
    ClearedTier,
    ClearReply,
    DeleteObjectsBody,
    DeleteObjectsReply,
    EncodedKey,
    HoldBody,
    HoldReply,
    ObjectEntry,
    ObjectPage,
    PrefetchBody,
    PrefetchStatusReply,
    PrefetchSubmitted,
    ReleaseReply,
    TierName,
    check_token_count,
)
from kvatlas.errors import InvalidInput, NotFound, Unavailable
from kvatlas.keys import ObjectKey, check_cache_salt, check_instance_id, parse_chunk_hash_hex
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.l2 import FsL2, L2Backend, key_digest
from kvatlas.node.presence import L1, L2, Tier

_TIERS: Final[dict[TierName, frozenset[Tier]]] = {
    "l1": frozenset({L1}),
    "l2": frozenset({L2}),
    "all": frozenset({L1, L2}),
}
log = logging.getLogger(__name__)
_ID_CHARS: Final = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
_DIGEST_CHARS: Final = 64  # a page token: the key digest the previous page ended at


def key_of(wire: EncodedKey) -> ObjectKey:
    """A wire key as an :class:`ObjectKey` (its invariants checked: ``ValueError``)."""
    return ObjectKey(
        parse_chunk_hash_hex(wire.chunk_hash_hex), wire.model_name, wire.kv_rank,
        wire.object_group_id, wire.cache_salt,
    )  # fmt: skip


def _check_hold_id(hold_id: str) -> None:
    if not 0 < len(hold_id) <= 128 or hold_id.strip(_ID_CHARS):
        raise InvalidInput(f"hold_id must be 1-128 of [A-Za-z0-9_.-], got {hold_id!r:.140}")


def wire_key(key: ObjectKey) -> EncodedKey:
    return EncodedKey(
        key.chunk_hash.hex(), key.model_name, key.kv_rank, key.object_group_id, key.cache_salt
    )


class _Job:
    __slots__ = ("done_at", "future", "total")

    def __init__(self, future: Future[int], total: int) -> None:
        self.future = future
        self.total = total
        self.done_at: float | None = None


class PrefetchJobs:
    """Prefetch jobs by request id: run one at a time off the request path, status kept for
    ``ttl_s`` after completion, at most ``max_jobs`` kept (the oldest completed dropped first;
    when every kept job is still running a new one is refused: 503)."""

    def __init__(
        self,
        ttl_s: float = 600.0,
        max_jobs: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_jobs = max_jobs
        self._clock = clock
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvatlas-prefetch")

    def submit(self, load: Callable[[], int], total: int) -> str:
        with self._lock:
            self._expire()
            self._make_room()
            request_id = uuid.uuid4().hex
            job = _Job(self._pool.submit(load), total)
            self._jobs[request_id] = job
        job.future.add_done_callback(lambda _f: self._completed(job))
        return request_id

    def _completed(self, job: _Job) -> None:
        error = job.future.exception()
        if error is not None:  # reported as found_keys 0; the cause goes to the log
            log.warning("prefetch failed: %s", error)
        with self._lock:
            job.done_at = self._clock()

    def status(self, request_id: str) -> PrefetchStatusReply:
        with self._lock:
            self._expire()
            job = self._jobs.get(request_id)
            if job is None or job.done_at is None:
                if job is None:
                    raise NotFound(
                        f"unknown prefetch request_id={request_id!r} (never submitted, or completed more than {self.ttl_s:g} s ago)"
                    )
                return PrefetchStatusReply(request_id, "pending")
        error = job.future.exception()
        found = 0 if error is not None else job.future.result()
        return PrefetchStatusReply(request_id, "completed", found_keys=found, total_keys=job.total)

    def _expire(self) -> None:
        """Drop completed jobs past their time."""
        now = self._clock()
        for rid in [
            r
            for r, j in self._jobs.items()
            if j.done_at is not None and now - j.done_at > self.ttl_s
        ]:
            del self._jobs[rid]

    def _make_room(self) -> None:
        """Below ``max_jobs``: the oldest completed jobs go (503 when all are running)."""
        for rid in [r for r, j in self._jobs.items() if j.done_at is not None]:
            if len(self._jobs) < self.max_jobs:
                return
            del self._jobs[rid]
        if len(self._jobs) >= self.max_jobs:
            raise Unavailable(f"{self.max_jobs} prefetches are running; try again later")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class NodeCacheControl:
    """The five MP-server operations on one :class:`CacheNode` (blocking: call them off the
    event loop)."""

    def __init__(self, node: CacheNode, jobs: PrefetchJobs | None = None) -> None:
        self.node = node
        self.jobs = jobs or PrefetchJobs()

    def delete_objects(self, body: DeleteObjectsBody) -> DeleteObjectsReply:
        if len(body.keys) > MAX_DELETE_KEYS:
            raise InvalidInput(
                f"too many keys in a single request (limit={MAX_DELETE_KEYS}, got={len(body.keys)})"
            )
        keys = []
        for i, wire in enumerate(body.keys):
            try:
                keys.append(key_of(wire))
            except ValueError as exc:
                raise InvalidInput(f"keys[{i}]: {exc}") from None
        tiers = _TIERS[body.tier]
        if L2 in tiers:
            self._l2_named(body.adapter)
        done = self.node.delete(keys, tiers, force=body.force)
        if done.error is not None:  # LMCache's shape: a result, not a 5xx
            return DeleteObjectsReply(done.deleted, done.skipped, False, error=done.error)
        return DeleteObjectsReply(done.deleted, done.skipped, True)

    def submit_prefetch(self, body: PrefetchBody) -> PrefetchSubmitted:
        if (body.source_tier, body.target_tier) != ("l2", "l1"):
            raise InvalidInput(
                f"unsupported prefetch direction {body.source_tier!r}->{body.target_tier!r}; "
                "only 'l2'->'l1'"
            )
        config = self.node.config
        if (body.model_name, body.world_size) != (config.model_name, config.world_size):
            raise Unavailable(
                f"no layout registered for model_name={body.model_name!r} "
                f"world_size={body.world_size}; this node serves model_name="
                f"{config.model_name!r} world_size={config.world_size}"
            )
        keys = self._keys_of_tokens(body.token_ids, body.cache_salt)
        if not keys:
            return PrefetchSubmitted(0, "noop")
        request_id = self.jobs.submit(lambda: self.node.load_into_l1(keys), len(keys))
        return PrefetchSubmitted(len(keys), "submitted", request_id=request_id)

    def prefetch_status(self, request_id: str) -> PrefetchStatusReply:
        return self.jobs.status(request_id)

    def hold(self, hold_id: str, body: HoldBody) -> HoldReply:
        """A move's target (``PUT /cache/holds/{hold_id}``): load what L1 lacks and hold it
        (:meth:`~kvatlas.node.moves.MoveTarget.load_and_hold`). 400 a model or world size this
        node does not serve, a bad id or key field; 503 the source could not be read (asked
        again later: setting a hold again is idempotent)."""
        _check_hold_id(hold_id)
        config = self.node.config
        if (body.model_name, body.world_size) != (config.model_name, config.world_size):
            raise InvalidInput(
                f"this node serves model_name={config.model_name!r} world_size="
                f"{config.world_size}, not model_name={body.model_name!r} world_size="
                f"{body.world_size}"
            )
        check_token_count(body.token_ids)
        try:
            check_cache_salt(body.cache_salt)
            check_instance_id(body.source_instance_id)
            tracker = self.node.tracker(token_ids=body.token_ids, cache_salt=body.cache_salt)
            tracker.chunk_hashes()
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        done = self.node.moves.load_and_hold(hold_id, tracker, body.source_instance_id, body.ttl_s)
        if done.source_failure:
            raise Unavailable(
                f"{len(done.missing)} keys not loaded: {done.source_failure} (the hold keeps "
                f"the {len(done.held)} keys L1 has)"
            )
        return HoldReply(
            hold_id, [wire_key(k) for k in done.held],
            [wire_key(k) for k in done.missing + done.no_room], len(done.no_room),
            done.unfinished,
        )  # fmt: skip

    def release(self, hold_id: str) -> ReleaseReply:
        _check_hold_id(hold_id)
        return ReleaseReply(hold_id, self.node.holds.release(hold_id))

    def list_objects(
        self,
        tier: TierName,
        adapter: str | None,
        model_name: str | None,
        page_size: int,
        page_token: str | None,
    ) -> ObjectPage:
        if tier != "l2":
            raise InvalidInput(f"tier {tier!r} not supported; only 'l2'")
        l2 = self._l2_named(adapter)
        if not isinstance(l2, FsL2) or l2.shared:
            raise Unavailable(
                f"L2 backend {l2.name!r} does not support listing (a private fs L2 does)"
            )
        if page_token is not None and (
            len(page_token) != _DIGEST_CHARS or page_token.strip("0123456789abcdef")
        ):
            raise InvalidInput(f"malformed page_token {page_token!r:.80}")
        held = l2.keys()
        ordered = sorted(
            (key_digest(k), k) for k in held if model_name is None or k.model_name == model_name
        )
        after = [(d, k) for d, k in ordered if page_token is None or d > page_token]
        page = after[:page_size]
        size = self.node.layout.chunk_bytes
        return ObjectPage(
            adapter=l2.name,
            shared=l2.shared,
            entries=[ObjectEntry(wire_key(k), size) for _d, k in page],
            next_page_token=page[-1][0] if len(after) > page_size else None,
        )

    def clear(self, body: ClearBody) -> ClearReply:
        if body.tier != "l1":
            raise InvalidInput(f"tier {body.tier!r} not supported; only 'l1'")
        self.node.clear_l1(force=body.force)
        return ClearReply("ok", ClearedTier("l1"))

    def close(self) -> None:
        self.jobs.close()

    def _l2_named(self, adapter: str | None) -> L2Backend:
        l2 = self.node.l2
        if l2 is None:
            raise Unavailable("no L2 adapters configured")
        if adapter is not None and adapter != l2.name:
            raise NotFound(f"no L2 adapter with type_name={adapter!r} (this node's is {l2.name!r})")
        return l2

    def _keys_of_tokens(self, token_ids: Sequence[int], cache_salt: str) -> list[ObjectKey]:
        """This node's keys of the complete chunks of ``token_ids`` (its own hashing and rank)."""
        check_token_count(token_ids)
        try:
            check_cache_salt(cache_salt)
            tracker = self.node.tracker(token_ids=token_ids, cache_salt=cache_salt)
            return [self.node.key(h, cache_salt) for h in tracker.chunk_hashes()]
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
