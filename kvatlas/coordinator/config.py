"""Coordinator configuration: every CLI flag, each also settable as ``KVATLAS_<NAME>``.

Precedence: command line > environment > default. The flag table is the contract in
coordinator.md §1; ``kvatlas coordinator --help`` prints it.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from kvatlas.keys import DEFAULT_CHUNK_SIZE, SCHEMES, KeyScheme

DEFAULT_PORT = 9300
TRANSPORTS = ("http", "redis")


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_scheme: str = "blake3"
    enable_blend_lookup: bool = False
    blend_probe_stride: int = 1
    event_transport: str = "http"
    redis_url: str | None = None
    event_stream: str = "kvatlas:events"
    consumer_group: str | None = None
    snapshot_path: Path | None = None
    snapshot_interval: float = 60.0
    instance_timeout: float = 30.0
    auth_token_file: Path | None = None
    max_query_tokens: int = 2 * 1024 * 1024
    max_batch_entries: int = 100_000
    max_body_bytes: int = 256 * 1024 * 1024
    log_level: str = "info"

    def __post_init__(self) -> None:
        KeyScheme(self.hash_scheme, self.chunk_size)  # validates both
        if self.blend_probe_stride < 1:
            raise ValueError("--blend-probe-stride must be >= 1")
        if self.event_transport not in TRANSPORTS:
            raise ValueError(f"--event-transport must be one of {', '.join(TRANSPORTS)}")
        if self.event_transport == "redis" and not self.redis_url:
            raise ValueError("--event-transport redis needs --redis-url")
        for name in ("max_query_tokens", "max_batch_entries", "max_body_bytes", "port"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.port > 65535:
            raise ValueError("--port must be <= 65535")
        for name in ("snapshot_interval", "instance_timeout"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0")

    @property
    def scheme(self) -> KeyScheme:
        return KeyScheme(self.hash_scheme, self.chunk_size)

    @property
    def group_name(self) -> str:
        """Each replica needs its own consumer group to build the full view."""
        return self.consumer_group or f"kvatlas-coordinator-{self.host}-{self.port}"


_HELP = {
    "host": "bind address (loopback by default)",
    "port": "bind port",
    "chunk_size": "fleet chunk size in tokens (the blend match window)",
    "hash_scheme": f"key scheme: {' or '.join(SCHEMES)}",
    "enable_blend_lookup": "index chunk content for fragment (blend) lookup",
    "blend_probe_stride": "query positions between blend probes (1 = every offset)",
    "event_transport": "how events arrive: http (POST /events) or redis (Redis Streams)",
    "redis_url": "Redis URL for the redis transport, e.g. redis://127.0.0.1:6379/0",
    "event_stream": "Redis Stream name carrying event batches",
    "consumer_group": "Redis consumer group (default: one per host:port, i.e. per replica)",
    "snapshot_path": "durable directory snapshot file (restored at start-up)",
    "snapshot_interval": "seconds between periodic snapshots",
    "instance_timeout": "seconds without heartbeat before an instance's L1 is fenced",
    "auth_token_file": "JSON token file enabling bearer-token auth (roles emit/lookup/admin)",
    "max_query_tokens": "largest lookup / blend-lookup query, in tokens",
    "max_batch_entries": "most entries in one POST /events body",
    "max_body_bytes": "largest request body, in bytes",
    "log_level": "log level (debug, info, warning, error)",
}


def _env_name(field: str) -> str:
    return "KVATLAS_" + field.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CoordinatorConfig()
    for f in fields(CoordinatorConfig):
        flag = "--" + f.name.replace("_", "-")
        env = _env_name(f.name)
        default = getattr(defaults, f.name)
        help_text = f"{_HELP[f.name]} [env {env}; default {default}]"
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    """Merge parsed flags over ``KVATLAS_*`` variables over defaults, converting types once."""
    env = os.environ if environ is None else environ
    defaults = CoordinatorConfig()
    values: dict[str, object] = {}
    for f in fields(CoordinatorConfig):
        raw = getattr(args, f.name, None)
        if raw is None and _env_name(f.name) in env:
            raw = env[_env_name(f.name)]
        if raw is None:
            continue
        default = getattr(defaults, f.name)
        try:
            values[f.name] = _convert(f.name, raw, default)
        except ValueError as exc:
            raise ValueError(f"--{f.name.replace('_', '-')}: {exc}") from None
    return CoordinatorConfig(**values)  # type: ignore[arg-type]


def _convert(name: str, raw: object, default: object) -> object:
    if isinstance(raw, bool):
        return raw
    text = str(raw)
    if isinstance(default, bool):
        return _parse_bool(text)
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if name in ("snapshot_path", "auth_token_file"):
        return Path(text) if text else None
    return text or None if name in ("redis_url", "consumer_group") else text


def parse_config(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    parser = argparse.ArgumentParser(prog="kvatlas coordinator")
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ)
