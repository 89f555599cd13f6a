"""``kvatlas router``, with ``--scores-from replica``: a coordinator replica in the router's own
process, so a score is a function call in the router (on its event loop, or its match pool),
not an HTTP round trip to another process (docs/router.md, "Scoring: over HTTP or from a
replica in the router").

The replica is built by the coordinator's own start-up code from the coordinator's own flags
(those :data:`REPLICA_FIELDS` names, offered on ``kvatlas router``): its replica id and consumer
group, the Redis stream every replica reads, its snapshot, its KV-event subscriptions. It
claims its snapshot lock and group as ``kvatlas coordinator`` does and is one more replica of
the fleet (docs/coordinator.md, "Replicas"); it serves no HTTP of its own. Scores are
:meth:`RouteScoring.score` — what ``POST /route/score`` answers — from the token ids the router
decoded, with no body encoded or decoded in between: on the router's event loop for a prompt of
up to :data:`INLINE_TOKENS` tokens while no change holds the directory, on the match pool for
a longer one or while one does (the loop never waits for the directory's lock).

This module sits at the top (beside the cli): the router package reaches the coordinator
only over HTTP, so the two are composed here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Final

import numpy as np
from prometheus_client import Metric

from kvatlas.api import RouteScoreBody, RouteScoresReply
from kvatlas.auth import ANONYMOUS_ADMIN, Principal, TokenAuth
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.config import add_arguments as add_coordinator_arguments
from kvatlas.coordinator.config import config_from_args as coordinator_config_from_args
from kvatlas.errors import KvatlasError
from kvatlas.router.config import RouterConfig
from kvatlas.router.config import config_from_args as router_config_from_args
from kvatlas.router.openai_body import TokenIds
from kvatlas.router.scores import Scorer

if TYPE_CHECKING:
    from kvatlas.coordinator.route_score import RouteScoring
    from kvatlas.coordinator.service import CoordinatorService

log = logging.getLogger(__name__)

NOT_OFFERED: Final = frozenset(
    {
        # the router's own flags of the same name (one process: one listener, one log)
        "host", "port", "auth_token_file", "max_body_bytes", "log_level", "log_format",
        "http_header_timeout_s", "http_body_timeout_s", "http_max_connections",
        # a replica without HTTP of its own
        "access_log", "public_metrics", "public_docs",
        # the heap trimmer is the coordinator process's (the router starts none); a replica
        # that delivers no cache-control commands reaches no MP server
        "memory_trim_interval_s", "node_token_file",
        # a replica that only scores does not publish the directory as KV events
        "kv_events_publish", "kv_events_replay_bind", "kv_events_replay_size",
        "kv_events_publish_encoding", "kv_events_publish_salts", "kv_events_curve_certificate",
        "kv_events_curve_clients", "kv_events_publish_unauthenticated",
    }
)  # fmt: skip
"""The coordinator's flags ``kvatlas router`` does not offer for its replica."""

REPLICA_FIELDS: Final = frozenset(
    f.name for f in fields(CoordinatorConfig) if f.name not in NOT_OFFERED
)
"""The coordinator's flags ``kvatlas router`` offers for ``--scores-from replica``."""

INLINE_TOKENS: Final = 16_384
"""Prompts up to this many tokens are scored on the router's event loop (≈0.3 ms of CPU per
4k tokens, docs/router.md); longer ones on the match pool, so one never stalls the loop for
long. The hop to a pool thread and back costs, on a loaded machine, two more wake-ups that
each wait for a time slice: measured, it added 0.8 ms to the time to first token (docs/router.md,
"Scoring"), as the coordinator's blend lookup answers small queries inline for the same reason
(``kvatlas.coordinator.blend_lookup.INLINE_BODY_BYTES``)."""

REPLICA_GROUP: Final = "coordinator replica (with --scores-from replica; the coordinator's flags)"


@dataclass(frozen=True)
class RouterLaunch:
    """``kvatlas router``'s flags: the router's, and its replica's (``--scores-from replica``)."""

    router: RouterConfig
    replica: CoordinatorConfig | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The coordinator's flags a replica in the router takes, in their own group."""
    add_coordinator_arguments(parser.add_argument_group(REPLICA_GROUP), REPLICA_FIELDS)


def launch_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RouterLaunch:
    """The router's config and, with ``--scores-from replica``, its replica's: the Redis
    transport is required (``ValueError`` naming the flags otherwise: a replica on the HTTP
    transport would hold only what is posted to it, i.e. nothing). The replica shares the
    router's ``--auth-token-file`` (verifying the stream's signed entries) and log settings."""
    router = router_config_from_args(args, environ)
    if router.scores_from != "replica":
        return RouterLaunch(router, None)
    replica = coordinator_config_from_args(args, environ, REPLICA_FIELDS)
    if replica.event_transport != "redis":
        raise ValueError(
            "--scores-from replica needs --event-transport redis and --redis-url: the replica "
            "reads the coordinators' Redis stream (with the http transport it would hold nothing)"
        )
    return RouterLaunch(router, dataclasses.replace(
        replica, auth_token_file=router.auth_token_file, log_level=router.log_level,
        log_format=router.log_format,
    ))  # fmt: skip


class ReplicaScorer:
    """Scores from the coordinator replica in this process (:meth:`RouteScoring.score`, on
    the event loop up to :data:`INLINE_TOKENS` tokens, on the match pool beyond, as the
    coordinator's own handlers choose); while it is not ``serving``
    (restoring, catching up, Redis away, resyncing), from ``fallback`` (the coordinator over
    HTTP, when ``--coordinator-url`` is given) or none (:class:`CoordinatorError`: the router
    routes by load and counts it)."""

    def __init__(
        self,
        service: CoordinatorService,
        scoring: RouteScoring,
        pool: Executor,
        fallback: Scorer | None = None,
        scores_as: Principal = ANONYMOUS_ADMIN,
    ) -> None:
        """``fallback``: the router's own HTTP scorer (its client, its counts: the JSON
        fallbacks of ``kvatlas_router_score_json_fallbacks_total``), or one of its own.
        ``scores_as``: the router's own token, applied to every score as the coordinator
        applies it over HTTP (:func:`scoring_principal`)."""
        self.service = service
        self.scoring = scoring
        self.pool = pool
        self.fallback = fallback
        self.scores_as = scores_as

    async def score(
        self,
        tokens: TokenIds,
        model_name: str,
        cache_salt: str,
        instances: Sequence[str],
        timeout: float,
        who: Principal | None = None,
    ) -> RouteScoresReply:
        """Refused (403) for a salt the client (``who``: its route token's binding) or the
        router's own token (``scores_as``: a ``lookup`` token's) may not see, as the router and
        then the coordinator refuse it over HTTP; scored as ``scores_as``."""
        from kvatlas.coordinator.views import Readiness

        state = self.service.state
        if state is not Readiness.SERVING:
            if self.fallback is not None:
                return await self.fallback.score(
                    tokens, model_name, cache_salt, instances, timeout, who
                )
            raise CoordinatorError(f"the router's replica is {state.value}, not serving")
        if who is not None:
            try:
                who.require_salts([cache_salt], role="route")
            except KvatlasError as exc:
                raise CoordinatorError(f"the router's replica refused: {exc}", exc.status) from None
        # the router's own token (scores_as): RouteScoring.score applies its binding, as over HTTP
        body = RouteScoreBody(model_name=model_name, cache_salt=cache_salt,
                              instances=list(instances))  # fmt: skip
        # the ids' little-endian bytes, as a msgpack body hands them over (writable, contiguous)
        packed = np.ascontiguousarray(tokens, dtype="<u4").view(np.uint8)
        # on the loop: within --score-timeout-s by its size, unless a change holds the
        # directory (a batch applied, a fence): the read would wait, and the loop with it
        if len(tokens) <= INLINE_TOKENS and not self.service.directory.busy():
            try:
                return self.scoring.score(body, self.scores_as, packed)
            except KvatlasError as exc:
                raise CoordinatorError(f"the router's replica refused: {exc}", exc.status) from None
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pool, self.scoring.score, body, self.scores_as, packed)
        try:
            async with asyncio.timeout(timeout):
                return await work
        except TimeoutError:
            raise CoordinatorError(
                f"the router's replica gave no score within {timeout} s"
            ) from None
        except KvatlasError as exc:  # refused as POST /route/score refuses (4xx there)
            raise CoordinatorError(f"the router's replica refused: {exc}", exc.status) from None

    def series(self) -> Iterable[Metric]:
        """The replica's health, by the coordinator's names
        (:meth:`~kvatlas.coordinator.metrics.CoordinatorMetrics.replica_health`)."""
        return self.service.metrics.replica_health()

    def status(self) -> str:
        """``replica <readiness>`` (and ``, http meanwhile`` while the fallback scores)."""
        state = self.service.state.value
        meanwhile = "" if state == "serving" or self.fallback is None else ", http meanwhile"
        return f"replica {state}{meanwhile}"

    async def aclose(self) -> None:
        if self.fallback is not None:
            await self.fallback.aclose()


def scoring_principal(config: RouterConfig, replica: CoordinatorConfig) -> Principal:
    """Who the router's replica scores as: the router's own token (``--coordinator-token-file``
    or ``--coordinator-token``) as the replica's token file (the router's ``--auth-token-file``)
    knows it, so that its ``lookup`` role and salt binding apply as a coordinator applies them
    to the same router over HTTP. Without auth, anyone (as a coordinator without auth); with
    auth and no such token, the router's clients' own bindings alone (docs/router.md, "Auth").
    ``ValueError`` naming the flag for a token the file does not hold, or for a token without
    a token file (its binding unknown)."""
    token = config.coordinator_bearer()
    if replica.auth_token_file is None:
        if token is not None:  # its salt binding cannot be known: refuse, not score as admin
            raise ValueError(
                "--coordinator-token-file (or --coordinator-token) with --scores-from replica "
                "needs --auth-token-file holding that token (the replica scores as it, as a "
                "coordinator would)"
            )
        return ANONYMOUS_ADMIN
    if token is None:
        return ANONYMOUS_ADMIN
    try:
        return TokenAuth.from_file(replica.auth_token_file).authenticate(f"Bearer {token}")
    except KvatlasError:
        raise ValueError(
            "--coordinator-token-file (or --coordinator-token): not a token of "
            "--auth-token-file (the router's replica scores as that token, as a coordinator "
            "would)"
        ) from None


def run(launch: RouterLaunch) -> int:
    """``kvatlas router``: with a replica, claim its snapshot lock and consumer group, start it
    (restore, stream consumer, KV-event links), serve the router with scores from it, stop it
    (its last snapshot) after the router stopped."""
    from kvatlas.router.server import run_router

    if launch.replica is None:
        return run_router(launch.router)
    return _run_with_replica(launch.router, launch.replica)


def _run_with_replica(config: RouterConfig, replica: CoordinatorConfig) -> int:
    from kvatlas.coordinator.app import new_query_pool
    from kvatlas.coordinator.route_score import RouteScoring
    from kvatlas.coordinator.runtime import set_switch_interval
    from kvatlas.coordinator.server import claim_or_exit, claim_state, stopper_of
    from kvatlas.coordinator.service import CoordinatorService
    from kvatlas.logs import configure_logging
    from kvatlas.router.server import run_router

    configure_logging(config.log_level, config.log_format)
    set_switch_interval()  # the coordinator's: the match threads and the loop share one GIL
    log.info("router's replica %s, consumer group %s, stream %s",
             replica.resolved_replica_id, replica.group_name, replica.event_stream)  # fmt: skip
    try:
        scores_as = scoring_principal(config, replica)
    except ValueError as exc:
        log.error("%s; not starting", exc)
        return 2
    lock = claim_or_exit(lambda: claim_state(replica), "replica with this id")
    pool = new_query_pool()
    try:
        service = CoordinatorService(replica, delivers=False)  # sends no commands: no MP servers
        service.start()  # failing, it never started: nothing to snapshot, nothing to stop
        try:
            scoring = RouteScoring(service, pool)
            # meanwhile, the router's own HTTP scorer (--coordinator-url): one client, counted
            return run_router(
                config,
                lambda http: ReplicaScorer(service, scoring, pool, http, scores_as),
                stopper_of(service),
            )
        finally:
            service.stop()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if lock is not None:
            lock.close()
