"""Coordinator configuration: every CLI flag, each also settable as ``KVATLAS_<NAME>``.

Precedence: command line > environment > default. The flag table is the contract documented
in docs/coordinator.md; ``kvatlas coordinator --help`` prints it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvatlas.config_flags import add_dataclass_arguments, dataclass_from_args
from kvatlas.events import EVENT_TRANSPORTS
from kvatlas.keys import DEFAULT_CHUNK_SIZE, SCHEMES, KeyScheme

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
    replica_id: str | None = None
    consumer_heartbeat: float = 10.0
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
        if self.event_transport not in EVENT_TRANSPORTS:
            raise ValueError(f"--event-transport must be one of {', '.join(EVENT_TRANSPORTS)}")
        if self.event_transport == "redis" and not self.redis_url:
            raise ValueError("--event-transport redis needs --redis-url")
        for name in ("max_query_tokens", "max_batch_entries", "max_body_bytes", "port"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.port > 65535:
            raise ValueError("--port must be <= 65535")
        for name in ("snapshot_interval", "instance_timeout", "consumer_heartbeat"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0")

    @property
    def scheme(self) -> KeyScheme:
        return KeyScheme(self.hash_scheme, self.chunk_size)

    @property
    def resolved_replica_id(self) -> str:
        """``--replica-id``, else this host's name and a hash of the snapshot path: stable
        across restarts, distinct across hosts, never derived from the bind address."""
        return self.replica_id or default_replica_id(socket.gethostname(), self.snapshot_path)

    @property
    def group_name(self) -> str:
        """Each replica needs its own consumer group to build the full view."""
        return self.consumer_group or f"kvatlas-{self.resolved_replica_id}"


def default_replica_id(hostname: str, snapshot_path: Path | None) -> str:
    where = "" if snapshot_path is None else os.path.abspath(snapshot_path)
    return f"{hostname}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"


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
    "consumer_group": "Redis consumer group (default: kvatlas-<replica id>, one per replica)",
    "replica_id": "this replica's id (default: host name + hash of the snapshot path)",
    "consumer_heartbeat": "seconds: a replica's consumer shows itself to Redis several times per "
    "interval; start-up refuses a group whose consumer is seen again within it (a live twin) "
    "and takes over one idle past it (a crashed replica's)",
    "snapshot_path": "durable directory snapshot file (restored at start-up)",
    "snapshot_interval": "seconds between periodic snapshots",
    "instance_timeout": "seconds without heartbeat before an instance's L1 is fenced",
    "auth_token_file": "JSON token file enabling bearer-token auth (roles emit/lookup/admin)",
    "max_query_tokens": "largest lookup / blend-lookup query, in tokens",
    "max_batch_entries": "most entries in one POST /events body",
    "max_body_bytes": "largest request body, in bytes",
    "log_level": "log level (debug, info, warning, error)",
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
