"""Router configuration: ``kvatlas router`` flags, each also ``KVATLAS_<NAME>``, each described
by ``kvatlas router --help`` (docs/router.md, "Flags").

The cost model's constants are flags with their sources in docs/router.md ("The kvatlas
policy"); a flag that names a concept the coordinator or node also has keeps their name
(``--coordinator-url``, ``--coordinator-token-file``, ``--auth-token-file``, ``--model-name``,
``--max-body-bytes``, the three ``--http-*`` limits of :mod:`kvatlas.http_guard`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, Final

from kvatlas.auth import TokenAuth, read_secret
from kvatlas.checks import check_http_url, check_port
from kvatlas.config_flags import (
    add_dataclass_arguments,
    check_choices,
    dataclass_from_args,
    env_name,
)
from kvatlas.http_limits import (
    BODY_TIMEOUT_HELP,
    HEADER_TIMEOUT_HELP,
    MAX_CONNECTIONS_HELP,
    HttpLimits,
)
from kvatlas.keys import check_instance_id
from kvatlas.logs import LOG_FORMATS, LOG_LEVELS
from kvatlas.router.policies import CostModel
from kvatlas.router.scores import SCORE_SOURCES

log = logging.getLogger(__name__)

POLICIES: Final = ("kvatlas", "prefix", "least-loaded", "round-robin", "random")
DEFAULT_METRICS_INTERVAL_S: Final = 1.0


@dataclass(frozen=True)
class RouterConfig:
    """``kvatlas router``'s flags (each also ``KVATLAS_<NAME>``)."""

    coordinator_url: str | None = None
    coordinator_token: str | None = None
    coordinator_token_file: Path | None = None
    engine: str | None = None
    engines_from_coordinator: bool = False
    engine_url_template: str | None = None
    policy: str = "kvatlas"
    scores_from: str = "http"
    tokenizer: Path | None = None
    chat_template: Path | None = None
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    auth_token_file: Path | None = None
    max_body_bytes: int = 8 << 20
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_max_connections: int | None = None  # None: below the file limit (http_guard)
    score_timeout_s: float = 0.05
    engine_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    health_interval_s: float = 1.0
    metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S
    prefill_tokens_per_s: float = 20_000.0
    kv_bytes_per_token: int = 131_072
    gpu_bandwidth_bytes_per_s: float = 0.0
    l1_bandwidth_bytes_per_s: float = 25e9
    l2_bandwidth_bytes_per_s: float = 7e9  # engine-sim's, the same flag (docs/router.md)
    peer_bandwidth_bytes_per_s: float = 12.5e9  # engine-sim's, the same flag
    recompute_share: float = 0.15
    seed: int = 0
    log_level: str = "info"
    log_format: str = "json"

    def __post_init__(self) -> None:
        self.http_limits  # noqa: B018 - validates the three --http-* limits
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}")
        if not self.engine and not self.engines_from_coordinator:
            raise ValueError("give --engine ID=URL (repeatable) or --engines-from-coordinator")
        if self.engines_from_coordinator and not self.coordinator_url:
            raise ValueError("--engines-from-coordinator needs --coordinator-url")
        if self.scores_from not in SCORE_SOURCES:
            raise ValueError(f"--scores-from must be one of {', '.join(SCORE_SOURCES)}")
        scoring = self.policy in ("kvatlas", "prefix")
        if scoring and self.scores_from == "http" and not self.coordinator_url:
            raise ValueError(
                f"--policy {self.policy} needs --coordinator-url (it scores there) or "
                "--scores-from replica"
            )
        if self.coordinator_url:
            check_http_url(self.coordinator_url, "--coordinator-url")
        parse_engines(self.engine or "")  # refuse a bad list at start, naming the item
        if self.engine_url_template:
            try:
                check_http_url(self.engine_url_template.format(instance_id="x"), "")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"--engine-url-template: an http(s) URL with {{instance_id}} only ({exc})"
                ) from None
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("--chat-template needs --tokenizer (the template's text is tokenized)")
        if self.kv_bytes_per_token < 0:
            raise ValueError("--kv-bytes-per-token must be >= 0")
        check_port("--port", self.port, 0)
        if self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be >= 1")
        positive = ("score_timeout_s", "engine_timeout_s", "connect_timeout_s",
                    "health_interval_s", "metrics_interval_s", "prefill_tokens_per_s")  # fmt: skip
        for name in positive:
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0")
        for tier in ("gpu", "l1", "l2", "peer"):
            if not 0 <= getattr(self, f"{tier}_bandwidth_bytes_per_s") < math.inf:  # NaN too
                raise ValueError(
                    f"--{tier}-bandwidth-bytes-per-s must be a finite number >= 0 (0 = free)"
                )
        if not 0.0 <= self.recompute_share <= 1.0:
            raise ValueError("--recompute-share must be in [0, 1]")
        check_choices(self, CHOICES)  # the rest (a variable's: argparse checks a flag's only)

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.http_header_timeout_s, self.http_body_timeout_s, self.http_max_connections
        )

    def cost_model(self) -> CostModel:
        """The kvatlas policy's constants as flagged."""
        return _cost_model(self)

    @property
    def engines(self) -> dict[str, str]:
        return parse_engines(self.engine or "")

    def auth(self) -> TokenAuth | None:
        """The router's own tokens (``--auth-token-file``; ``None`` = no auth)."""
        if self.auth_token_file is None:
            return None
        return TokenAuth.from_file(self.auth_token_file)  # private, long tokens: one rule

    def coordinator_bearer(self) -> str | None:
        """The coordinator token: ``--coordinator-token-file``, else the flag or environment
        (``KVATLAS_COORDINATOR_TOKEN``), by the node's rule (:func:`kvatlas.auth.read_secret`)."""
        return read_secret(
            self.coordinator_token, self.coordinator_token_file, "--coordinator-token"
        )


def _cost_model(flags: Any) -> CostModel:
    bandwidths = {
        tier: float(getattr(flags, f"{tier}_bandwidth_bytes_per_s"))
        for tier in ("gpu", "l1", "l2", "peer")
    }
    return CostModel(flags.prefill_tokens_per_s, flags.kv_bytes_per_token, bandwidths,
                     flags.recompute_share)  # fmt: skip


def default_cost_model() -> CostModel:
    """The kvatlas policy's constants at their flag defaults (what ``kvatlas router`` runs
    without cost flags; the virtual fleet benchmark's router)."""
    defaults = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(RouterConfig)})
    return _cost_model(defaults)


def parse_engines(text: str) -> dict[str, str]:
    """``ID=URL`` items separated by commas or whitespace (the flag may also be repeated:
    argparse joins them) → ``{id: url}``; a repeated id or a bad URL is refused."""
    engines: dict[str, str] = {}
    for item in text.replace(",", " ").split():
        engine_id, sep, url = item.partition("=")
        if not sep or not engine_id:
            raise ValueError(f"--engine: {item!r} is not ID=URL")
        check_instance_id(engine_id)
        if engine_id in engines:
            raise ValueError(f"--engine: {engine_id!r} given twice")
        engines[engine_id] = check_http_url(url, f"--engine {engine_id}")
    return engines


HELP: Final = MappingProxyType(
    {
        "coordinator_url": "the kvatlas coordinator that scores engines (POST /route/score)",
        "coordinator_token": "bearer token for the coordinator (lookup role; not set: none); "
        "visible in the process list as a flag: prefer --coordinator-token-file or the "
        "environment",
        "coordinator_token_file": "file holding a coordinator token with the lookup role "
        "(mode 600, >= 32 characters)",
        "engine": "an engine as ID=URL (ID = its id in the directory, the KV-events topic's "
        "emitter); repeatable or comma-separated",
        "engines_from_coordinator": "also route to the instances GET /instances lists with "
        "metadata.openai_url (or --engine-url-template), refreshed every --health-interval-s",
        "engine_url_template": "URL of a coordinator-listed instance without metadata.openai_url, "
        "e.g. http://{instance_id}:8000 (not set: such instances are skipped)",
        "policy": "how an engine is chosen (docs/router.md has each formula)",
        "scores_from": "where the kvatlas and prefix policies get scores: the coordinator at "
        "--coordinator-url (http) or a coordinator replica in this process, reading the Redis "
        "stream with the coordinator's flags below (replica; until it is serving, scores come "
        "over http if --coordinator-url is given, else requests are routed by load and counted)",
        "tokenizer": "the engines' Hugging Face tokenizer.json (or a model directory holding "
        "tokenizer.json and tokenizer_config.json); without it text is routed by load",
        "chat_template": "the model's Jinja chat template (a .jinja file or a "
        "tokenizer_config.json); default: the one in the tokenizer's directory",
        "model_name": "model name the directory keys the engines' KV under (the KV-events "
        "topic's model; default: the request's model)",
        "host": "address to listen on",
        "port": "port to listen on",
        "auth_token_file": "JSON token file (the coordinator's format): requests need a route "
        "token; a salt-bound token routes only its cache_salts (default: no auth)",
        "max_body_bytes": "largest request body (413 beyond)",
        "http_header_timeout_s": HEADER_TIMEOUT_HELP,
        "http_body_timeout_s": BODY_TIMEOUT_HELP,
        "http_max_connections": MAX_CONNECTIONS_HELP,
        "score_timeout_s": "longest wait for the coordinator's score; then route by load",
        "engine_timeout_s": "longest wait for an engine's reply (and between streamed bytes)",
        "connect_timeout_s": "longest wait to connect to an engine (then retry once elsewhere)",
        "health_interval_s": "how often each engine's /health and /v1/models are checked",
        "metrics_interval_s": "how often each engine's /metrics (vLLM's gauges) is scraped",
        "prefill_tokens_per_s": "kvatlas policy: one engine's prefill rate",
        "kv_bytes_per_token": "kvatlas policy: KV bytes per token (2 x layers x KV heads x "
        "head dim x dtype bytes; default Llama-3-8B bf16)",
        "gpu_bandwidth_bytes_per_s": "kvatlas policy: fetch rate of KV in the engine's GPU "
        "(0 = free: it is already there)",
        "l1_bandwidth_bytes_per_s": "kvatlas policy: fetch rate from host DRAM (CPU offload, "
        "node L1) into the GPU",
        "l2_bandwidth_bytes_per_s": "kvatlas policy: fetch rate from a node's L2 / a shared pool "
        "(default: a PCIe 4.0 x4 NVMe drive)",
        "peer_bandwidth_bytes_per_s": "kvatlas policy: fetch rate from a peer node's L1 "
        "(default: 100 Gb Ethernet)",
        "recompute_share": "kvatlas policy: share of fragment tokens recomputed (CacheBlend)",
        "seed": "seed of the random policy and of tie-breaks",
        "log_level": "log level",
        "log_format": "log format",
    }
)

CHOICES: Final = MappingProxyType(
    {
        "policy": POLICIES,
        "scores_from": SCORE_SOURCES,
        "log_level": LOG_LEVELS,
        "log_format": LOG_FORMATS,
    }
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, RouterConfig, HELP, CHOICES, repeatable=("engine",))


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RouterConfig:
    if getattr(args, "coordinator_token", None):
        log.warning(
            "--coordinator-token on the command line shows in the process list; use "
            "--coordinator-token-file or %s", env_name("coordinator_token"),
        )  # fmt: skip
    return dataclass_from_args(RouterConfig, args, environ)
