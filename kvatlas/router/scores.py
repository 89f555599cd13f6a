"""Where the router's scores come from (``--scores-from``, docs/router.md, "Scoring").

A :class:`Scorer` answers what ``POST /route/score`` answers — every candidate's coverage of a
prompt, best first, as :class:`kvatlas.api.RouteScoresReply` — or raises
:class:`~kvatlas.client.coordinator_client.CoordinatorError` when it has no score (the router
then routes by load and counts it). Two exist:

* :class:`HttpScorer` (``--scores-from http``, the default): the coordinator over HTTP
  (:class:`~kvatlas.client.route_client.AsyncRouteClient`, a msgpack body);
* a coordinator replica in the router's own process (``--scores-from replica``): composed
  above this package (``kvatlas.router_replica``), since a gateway imports no coordinator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client import Metric

from kvatlas.api import RouteScoresReply
from kvatlas.auth import Principal
from kvatlas.client.route_client import AsyncRouteClient
from kvatlas.router.openai_body import TokenIds

__all__ = ["SCORE_SOURCES", "HttpScorer", "Scorer", "ScorerOf"]

SCORE_SOURCES = ("http", "replica")
"""``--scores-from``'s choices."""


class Scorer(Protocol):
    """Scores a prompt for the router's candidates."""

    async def score(
        self,
        tokens: TokenIds,
        model_name: str,
        cache_salt: str,
        instances: Sequence[str],
        timeout: float,
        who: Principal | None = None,
    ) -> RouteScoresReply:
        """Every one of ``instances``, best first (``CoordinatorError``: no score had within
        ``timeout`` seconds, or refused). ``who``: the client the router admitted (``None``:
        router auth off), whose salt binding a replica applies itself; over HTTP the
        coordinator applies the router's own token instead."""
        ...

    def status(self) -> str:
        """Where scores come from now, for ``/healthz`` (``http``, ``replica serving``, ...)."""
        ...

    def series(self) -> Iterable[Metric]:
        """The scorer's own series for the router's ``/metrics`` (a replica's health, by the
        coordinator's names; none over HTTP: the coordinator exports its own)."""
        ...

    async def aclose(self) -> None:
        """Release what the scorer holds (connections)."""
        ...


ScorerOf = Callable[["HttpScorer | None"], Scorer]
"""The router's scorer made from its own HTTP scorer (``None`` without ``--coordinator-url``):
``--scores-from replica`` scores from its replica and, while it is not serving, through that
one, so the router's client (and its counts) serve both."""


class HttpScorer:
    """``POST /route/score`` at the coordinator (``--coordinator-url``)."""

    def __init__(self, client: AsyncRouteClient, *, owned: bool = False) -> None:
        """``owned``: :meth:`aclose` closes ``client`` (else its owner does: the router's
        own client, which also lists engines)."""
        self.client = client
        self.owned = owned

    async def score(
        self,
        tokens: TokenIds,
        model_name: str,
        cache_salt: str,
        instances: Sequence[str],
        timeout: float,
        who: Principal | None = None,
    ) -> RouteScoresReply:
        return await self.client.score(
            tokens, model_name, cache_salt=cache_salt, instances=instances, timeout=timeout
        )

    def status(self) -> str:
        return "http"

    def series(self) -> Iterable[Metric]:
        return ()

    async def aclose(self) -> None:
        if self.owned:
            await self.client.aclose()
