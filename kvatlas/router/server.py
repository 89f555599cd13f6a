"""``kvatlas router``: the ASGI app (the completion routes answered in front of Starlette, the
other routes Starlette's), and the process: load the tokenizer, bind the port, serve under the
HTTP guard (:mod:`kvatlas.http_guard`: header and body timeouts, the connection cap, one send
per loop turn) until SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Final

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.asgi_thread import StopServing, bind_listener, serve
from kvatlas.logs import configure_logging, uvicorn_log_options
from kvatlas.router.app import Router
from kvatlas.router.config import RouterConfig
from kvatlas.router.openai_body import Kind
from kvatlas.router.replies import CutReplyFilter, error_body, openai_error
from kvatlas.router.scores import ScorerOf
from kvatlas.router.tokenizer import PromptTokenizer
from kvatlas.web import is_loopback

log = logging.getLogger(__name__)


_COMPLETION_PATHS: Final[dict[str, Kind]] = {
    "/v1/completions": "completions", "/v1/chat/completions": "chat",
}  # fmt: skip


class _Completions:
    """The outermost ASGI layer: ``POST`` to a completion path goes to :meth:`Router.handle`,
    everything else (other routes, other methods: 405) to Starlette."""

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _COMPLETION_PATHS.get(scope["path"])
            if kind is not None:
                await self.router.handle(kind, scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(router: Router) -> ASGIApp:
    async def completions(_: Request) -> Response:  # only reached by other methods: 405
        raise AssertionError("POST completions are answered in front of Starlette")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/healthz", router.healthz, methods=["GET"]),
            Route("/metrics", router.prometheus, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _openai_http_error},
    )
    return _Completions(app, router)


async def _openai_http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown path 404, a wrong method 405 with its ``allow``)
    as OpenAI error objects, as the router's other errors are."""
    assert isinstance(exc, HTTPException)
    reply = openai_error(exc.status_code, exc.detail)
    reply.headers.update(exc.headers or {})
    return reply


def build_router(config: RouterConfig, scorer_of: ScorerOf | None = None) -> Router:
    """The router of ``config`` (``ValueError`` naming the flag when a file cannot be used);
    ``scorer_of``: where its scores come from (default: the coordinator over HTTP)."""
    tokenizer = None
    if config.tokenizer is not None:
        tokenizer = PromptTokenizer(config.tokenizer, config.chat_template)
    return Router(config, tokenizer, scorer_of)


def run_router(
    config: RouterConfig, scorer_of: ScorerOf | None = None, stopper: StopServing | None = None
) -> int:
    """``kvatlas router`` (``scorer_of``, ``stopper``: handed in by ``--scores-from replica``'s
    composition, ``kvatlas.router_replica``, which configured the logging already; its replica
    stops the router, exit 1, when Redis refuses its credentials)."""
    configure_logging(config.log_level, config.log_format)
    try:
        router = build_router(config, scorer_of)
    except ValueError as exc:
        log.error("%s; not starting", exc)
        return 2
    try:
        sock = bind_listener(config.host, config.port)
    except OSError as exc:
        log.error("%s; not starting", exc.strerror or exc)
        return 1
    if router.auth is None and not is_loopback(config.host):
        log.warning("router on %s without --auth-token-file: anyone reaching it may use the engines",
                    config.host)  # fmt: skip
    log.info(
        "kvatlas router on http://%s:%d: policy %s, scores from %s, %d engine(s)%s, tokenizer %s",
        config.host, config.port, config.policy, config.scores_from, len(config.engines),
        " + the coordinator's" if config.engines_from_coordinator else "",
        "on" if router.tokenizer is not None else "off (text routed by load)",
    )  # fmt: skip
    logging.getLogger("uvicorn.error").addFilter(CutReplyFilter())  # (cut replies: counted)
    try:
        serve(create_app(router), host=config.host, port=config.port, sock=sock,
              limits=config.http_limits, on_refused=router.metrics.http_refused.count,
              error_body=error_body, stopper=stopper,
              **uvicorn_log_options(config.log_level, False))  # fmt: skip
    finally:
        sock.close()
    return 0 if stopper is None else stopper.exit_code()
