"""Coordinator configuration: every CLI flag, each also settable as ``KVATLAS_<NAME>``.

Precedence: command line > environment > default. The flag table is the contract documented
in docs/coordinator.md; ``kvatlas coordinator --help`` prints it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvatlas.config_flags import add_dataclass_arguments, dataclass_from_args
from kvatlas.events import EVENT_TRANSPORTS
from kvatlas.events.vllm_wire import ENCODINGS
from kvatlas.keys import DEFAULT_CHUNK_SIZE, SCHEMES, KeyScheme, check_model_name

DEFAULT_PORT = 9300


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
    kv_events_subscribe: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic_prefix: str = "kv@"
    kv_events_model: str | None = None
    kv_events_max_blocks: int = 500_000
    kv_events_publish: str | None = None
    kv_events_replay_bind: str | None = None
    kv_events_replay_size: int = 10_000
    kv_events_publish_encoding: str = "map"

    def __post_init__(self) -> None:
        KeyScheme(self.hash_scheme, self.chunk_size)  # validates both
        if self.blend_probe_stride < 1:
            raise ValueError("--blend-probe-stride must be >= 1")
        if self.event_transport not in EVENT_TRANSPORTS:
            raise ValueError(f"--event-transport must be one of {', '.join(EVENT_TRANSPORTS)}")
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
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        for name in ("kv_events_max_blocks", "kv_events_replay_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        replay = self.kv_events_replay_endpoints
        if replay and len(replay) != len(self.kv_events_endpoints):
            raise ValueError(
                "--kv-events-replay pairs one replay endpoint (or an empty one) with each "
                "--kv-events-subscribe endpoint, by position"
            )
        if self.kv_events_replay_bind and not self.kv_events_publish:
            raise ValueError("--kv-events-replay-bind needs --kv-events-publish")
        if self.kv_events_model is not None:
            check_model_name(self.kv_events_model)
        if self.kv_events_publish_encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-publish-encoding must be one of {', '.join(ENCODINGS)}")

    @property
    def kv_events_endpoints(self) -> tuple[str, ...]:
        """``--kv-events-subscribe``, split at commas."""
        return _endpoints(self.kv_events_subscribe)

    @property
    def kv_events_replay_endpoints(self) -> tuple[str | None, ...]:
        """``--kv-events-replay`` by position (an empty item: that publisher has none)."""
        return tuple(e or None for e in _endpoints(self.kv_events_replay, keep_empty=True))

    @property
    def scheme(self) -> KeyScheme:
        return KeyScheme(self.hash_scheme, self.chunk_size)

    @property
    def group_name(self) -> str:
        """Each replica needs its own consumer group to build the full view."""
        return self.consumer_group or f"kvatlas-coordinator-{self.host}-{self.port}"


def _endpoints(text: str | None, *, keep_empty: bool = False) -> tuple[str, ...]:
    items = [e.strip() for e in (text or "").split(",")] if text else []
    return tuple(e for e in items if e or keep_empty)


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
    "kv_events_subscribe": "vLLM KV event publishers to subscribe to (ZMQ), e.g. "
    "tcp://engine-a:5557,tcp://engine-b:5557",
    "kv_events_replay": "their replay (ROUTER) endpoints, by position; an empty item: none",
    "kv_events_topic_prefix": "topic filter for --kv-events-subscribe",
    "kv_events_model": "model name for engine topics that carry none (kv@<engine>)",
    "kv_events_max_blocks": "most vLLM blocks tracked (all engines); the oldest go first",
    "kv_events_publish": "publish node placements as vLLM KV events on this ZMQ endpoint, "
    "e.g. tcp://*:5560",
    "kv_events_replay_bind": "replay (ROUTER) endpoint for the published events",
    "kv_events_replay_size": "published messages kept for replay",
    "kv_events_publish_encoding": "map (current vLLM: maps with a type tag) or array (structs as "
    "arrays, for routers decoding vLLM's array_like structs)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, CoordinatorConfig, _HELP)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    return dataclass_from_args(CoordinatorConfig, args, environ)


def parse_config(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    parser = argparse.ArgumentParser(prog="kvatlas coordinator")
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ)
