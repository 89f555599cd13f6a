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
from kvatlas.coordinator.kv_events.subscriber import MIN_MESSAGE_BYTES, LinkSpec
from kvatlas.coordinator.scoring import DEFAULT_FRAGMENT_WEIGHT
from kvatlas.events import EVENT_TRANSPORTS
from kvatlas.events.vllm_wire import DEFAULT_ENCODING, ENCODINGS
from kvatlas.keys import DEFAULT_CHUNK_SIZE, SCHEMES, KeyScheme, check_model_name
from kvatlas.logs import LOG_FORMATS, LOG_LEVELS

DEFAULT_PORT = 9300

QUERY_ENVELOPE_BYTES = 64 * 1024
"""A lookup body's JSON beside its tokens: field names, model name, salt, whitespace."""
ENTRY_ENVELOPE_BYTES = 768
"""One event entry's JSON beside its token ids: the key (64 hex digits, a model name of up to
256 and a salt of up to 128 characters, ``kv_rank``, group), size, offset, field names."""
TOKEN_JSON_BYTES = 11
"""One token id in a JSON list at worst: ten digits and a comma."""


def largest_request_bytes(max_query_tokens: int, max_batch_entries: int, chunk_size: int) -> int:
    """The default ``--max-body-bytes``: the larger of a full-context lookup (``tokens_b64`` of
    ``max_query_tokens`` uint32s: 4 base64 characters per 3 bytes) and a full ``POST /events``
    body (``max_batch_entries`` token-bearing entries of ``chunk_size`` tokens, in JSON).
    Documented in docs/coordinator.md ("Limits")."""
    query = 4 * -(-4 * max_query_tokens // 3) + QUERY_ENVELOPE_BYTES
    batch = max_batch_entries * (ENTRY_ENVELOPE_BYTES + TOKEN_JSON_BYTES * chunk_size)
    return max(query, batch)


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_scheme: str = "blake3"
    enable_blend_lookup: bool = True
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
    max_batch_entries: int = 32_768
    max_body_bytes: int | None = None  # None: derived from the other limits (body_limit)
    log_level: str = "info"
    max_instances: int = 10_000
    emitter_retention: float = 3600.0
    public_metrics: bool | None = None  # None: public exactly when auth is off
    public_docs: bool | None = None
    fragment_weight: float = DEFAULT_FRAGMENT_WEIGHT
    kv_events_subscribe: str | None = None
    kv_events_bind: str | None = None
    kv_events_replay: str | None = None
    kv_events_max_engines_per_endpoint: int = 1
    kv_events_topic_prefix: str = "kv@"
    kv_events_model: str | None = None
    kv_events_max_blocks: int = 500_000
    kv_events_max_message_bytes: int | None = None  # None: derived (largest_message_bytes)
    kv_events_publish: str | None = None
    kv_events_replay_bind: str | None = None
    kv_events_replay_size: int = 10_000
    kv_events_publish_encoding: str = DEFAULT_ENCODING
    log_format: str = "json"
    access_log: bool = False

    def __post_init__(self) -> None:
        KeyScheme(self.hash_scheme, self.chunk_size)  # validates both
        if self.blend_probe_stride < 1:
            raise ValueError("--blend-probe-stride must be >= 1")
        if self.event_transport not in EVENT_TRANSPORTS:
            raise ValueError(f"--event-transport must be one of {', '.join(EVENT_TRANSPORTS)}")
        if self.event_transport == "redis" and not self.redis_url:
            raise ValueError("--event-transport redis needs --redis-url")
        for name in ("max_query_tokens", "max_batch_entries", "max_instances", "port"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.port > 65535:
            raise ValueError("--port must be <= 65535")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be >= 1")
        if not math.isfinite(self.fragment_weight) or self.fragment_weight < 0:
            raise ValueError("--fragment-weight must be a finite number >= 0")
        for name in (
            "snapshot_interval",
            "instance_timeout",
            "emitter_retention",
            "consumer_heartbeat",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0")
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        for name in (
            "kv_events_max_blocks",
            "kv_events_replay_size",
            "kv_events_max_engines_per_endpoint",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        replay = self.kv_events_replay_endpoints
        n_links = len(self.kv_events_endpoints) + len(_endpoints(self.kv_events_bind))
        if replay and len(replay) != n_links:
            raise ValueError(
                "--kv-events-replay pairs one replay endpoint (or an empty one) with each "
                "--kv-events-subscribe endpoint, then each --kv-events-bind one, by position"
            )
        self.kv_events_links  # noqa: B018 (parses every item: a bad engine id raises here)
        if self.kv_events_replay_bind and not self.kv_events_publish:
            raise ValueError("--kv-events-replay-bind needs --kv-events-publish")
        limit = self.kv_events_max_message_bytes
        if limit is not None and limit < MIN_MESSAGE_BYTES:
            raise ValueError(
                f"--kv-events-max-message-bytes must be >= {MIN_MESSAGE_BYTES} (ZMQ applies it "
                "to the handshake too)"
            )
        if self.kv_events_model is not None:
            check_model_name(self.kv_events_model)
        if self.kv_events_publish_encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-publish-encoding must be one of {', '.join(ENCODINGS)}")

    @property
    def kv_events_endpoints(self) -> tuple[str, ...]:
        """``--kv-events-subscribe``, split at commas."""
        return _endpoints(self.kv_events_subscribe)

    @property
    def kv_events_links(self) -> tuple[LinkSpec, ...]:
        """Every subscribed (connected) then bound endpoint, each with its replay endpoint."""
        items = [(e, False) for e in self.kv_events_endpoints]
        items += [(e, True) for e in _endpoints(self.kv_events_bind)]
        replay = self.kv_events_replay_endpoints or (None,) * len(items)
        try:
            return tuple(
                LinkSpec.parse(item, bind=bind, replay=r)
                for (item, bind), r in zip(items, replay, strict=True)
            )
        except ValueError as exc:
            raise ValueError(
                f"--kv-events-subscribe / --kv-events-bind ENGINE=ENDPOINT: {exc}"
            ) from None

    @property
    def kv_events_replay_endpoints(self) -> tuple[str | None, ...]:
        """``--kv-events-replay`` by position (an empty item: that publisher has none)."""
        return tuple(e or None for e in _endpoints(self.kv_events_replay, keep_empty=True))

    @property
    def scheme(self) -> KeyScheme:
        return KeyScheme(self.hash_scheme, self.chunk_size)

    @property
    def body_limit(self) -> int:
        """``--max-body-bytes``, or by default the largest legitimate request (see
        :func:`largest_request_bytes`)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return largest_request_bytes(self.max_query_tokens, self.max_batch_entries, self.chunk_size)

    @property
    def metrics_public(self) -> bool:
        return (
            (self.auth_token_file is None) if self.public_metrics is None else self.public_metrics
        )

    @property
    def docs_public(self) -> bool:
        return (self.auth_token_file is None) if self.public_docs is None else self.public_docs

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


def _endpoints(text: str | None, *, keep_empty: bool = False) -> tuple[str, ...]:
    items = [e.strip() for e in (text or "").split(",")] if text else []
    return tuple(e for e in items if e or keep_empty)


_HELP = {
    "host": "bind address (loopback by default)",
    "port": "bind port",
    "chunk_size": "fleet chunk size in tokens (the blend match window)",
    "hash_scheme": "key scheme (chunk hash); every node's must equal it",
    "enable_blend_lookup": (
        "index chunk content for fragment (blend) lookup (LMCache's default, off: "
        "--no-enable-blend-lookup)"
    ),
    "blend_probe_stride": "query positions between blend probes (1 = every offset)",
    "event_transport": "how events arrive: POST /events (http) or Redis Streams (redis)",
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
    "auth_token_file": "JSON token file enabling bearer-token auth (docs/security.md)",
    "max_query_tokens": "largest lookup / blend-lookup query, in tokens",
    "max_batch_entries": "most entries in one POST /events body",
    "max_body_bytes": "largest request body, in bytes (default: derived from the two limits "
    "above and --chunk-size, see docs/coordinator.md)",
    "log_level": "log level",
    "log_format": "log lines as JSON objects (json) or plain text for humans (text)",
    "access_log": "log one line per HTTP request",
    "max_instances": "most registered instances, and most emitters the directory tracks",
    "emitter_retention": "seconds after which an unregistered, silent emitter is forgotten "
    "(its cursor and metric series)",
    "public_metrics": "serve /metrics without a token (default: only when auth is off)",
    "public_docs": "serve /docs and /openapi.json without a token (default: only when auth is off)",
    "fragment_weight": "route scoring: share at which fragment (blend) tokens count "
    "(docs/route-scoring.md)",
    "kv_events_subscribe": "vLLM KV event publishers to connect to (ZMQ; vLLM binds when its "
    "endpoint has a wildcard), [ENGINE=]ENDPOINT, e.g. pod-a=tcp://engine-a:5557,tcp://engine-b:5557",
    "kv_events_bind": "endpoints to bind for vLLM KV event publishers that connect (a vLLM "
    "endpoint with a host address), [ENGINE=]ENDPOINT, e.g. pod-a=tcp://127.0.0.1:5557",
    "kv_events_replay": "the publishers' replay (ROUTER) endpoints, by position (the "
    "--kv-events-subscribe ones, then the --kv-events-bind ones); an empty item: none",
    "kv_events_max_engines_per_endpoint": "most engines an endpoint without ENGINE= may speak "
    "for (topics naming more are refused and counted)",
    "kv_events_topic_prefix": "topic filter for --kv-events-subscribe",
    "kv_events_model": "model name for engine topics that carry none (kv@<engine>)",
    "kv_events_max_blocks": "most vLLM blocks tracked (all engines); the oldest go first",
    "kv_events_max_message_bytes": "largest ZMQ frame taken from a KV-event publisher (ZMQ "
    "drops a peer that sends more; default: 256 B x --kv-events-max-blocks, docs/kv-events.md)",
    "kv_events_publish": "publish node placements as vLLM KV events on this ZMQ endpoint, "
    "e.g. tcp://*:5560",
    "kv_events_replay_bind": "replay (ROUTER) endpoint for the published events",
    "kv_events_replay_size": "published messages kept for replay",
    "kv_events_publish_encoding": "vllm (exactly what vLLM emits: the batch an array, events maps "
    "tagged by type), array (older vLLM releases: every struct an array) or map (the batch a map "
    "too; no vLLM release emits it)",
}


_CHOICES = {
    "hash_scheme": SCHEMES,
    "event_transport": EVENT_TRANSPORTS,
    "log_level": LOG_LEVELS,
    "log_format": LOG_FORMATS,
    "kv_events_publish_encoding": ENCODINGS,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, CoordinatorConfig, _HELP, _CHOICES)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    return dataclass_from_args(CoordinatorConfig, args, environ)


def parse_config(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    parser = argparse.ArgumentParser(prog="kvatlas coordinator", exit_on_error=False)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as exc:  # a value outside a flag's choices, say
        raise ValueError(str(exc)) from None
    return config_from_args(args, environ)
