"""``kvatlas router``: load the tokenizer, bind the port, serve until SIGINT or SIGTERM."""

from __future__ import annotations

import logging

from kvatlas.asgi_thread import bind_listener, serve
from kvatlas.logs import configure_logging, uvicorn_log_options
from kvatlas.router.app import Router, create_app
from kvatlas.router.config import RouterConfig
from kvatlas.router.tokenizer import PromptTokenizer
from kvatlas.web import is_loopback

log = logging.getLogger(__name__)


def build_router(config: RouterConfig) -> Router:
    """The router of ``config`` (``ValueError`` naming the flag when a file cannot be used)."""
    tokenizer = None
    if config.tokenizer is not None:
        tokenizer = PromptTokenizer(config.tokenizer, config.chat_template)
    return Router(config, tokenizer)


def run_router(config: RouterConfig) -> int:
    configure_logging(config.log_level, config.log_format)
    try:
        router = build_router(config)
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
        "kvatlas router on http://%s:%d: policy %s, %d engine(s)%s, tokenizer %s",
        config.host, config.port, config.policy, len(config.engines),
        " + the coordinator's" if config.engines_from_coordinator else "",
        "on" if router.tokenizer is not None else "off (text routed by load)",
    )  # fmt: skip
    try:
        serve(create_app(router), host=config.host, port=config.port, sock=sock,
              **uvicorn_log_options(config.log_level, False))  # fmt: skip
    finally:
        sock.close()
    return 0
