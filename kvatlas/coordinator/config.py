"""Coordinator configuration: every CLI flag, each also settable as ``KVATLAS_<NAME>``.

Precedence: command line > environment > default. The flag table is the contract documented
in docs/coordinator.md; ``kvatlas coordinator --help`` prints it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvatlas.auth import public_unless_auth, read_secret
from kvatlas.checks import check_port
from kvatlas.config_flags import (
    FlagParser,
    add_dataclass_arguments,
    check_choices,
    dataclass_from_args,
)
from kvatlas.coordinator.body_limits import RouteBodies, largest_request_bytes
from kvatlas.coordinator.cache_control.eviction import DEFAULT_POLICY as DEFAULT_EVICTION_POLICY
from kvatlas.coordinator.cache_control.eviction import POLICY_NAMES as EVICTION_POLICIES
from kvatlas.coordinator.kv_events.exposure import StreamExposure
from kvatlas.coordinator.kv_events.settings import DEFAULT_MAX_BLOCKS, MIN_MESSAGE_BYTES, LinkSpec
from kvatlas.coordinator.runtime import TRIM_INTERVAL_S
from kvatlas.coordinator.scoring import DEFAULT_FRAGMENT_WEIGHT, checked_weight
from kvatlas.events import EVENT_TRANSPORTS
from kvatlas.events.vllm_wire import DEFAULT_ENCODING, ENCODINGS
from kvatlas.http_limits import (
    BODY_TIMEOUT_HELP,
    HEADER_TIMEOUT_HELP,
    MAX_CONNECTIONS_HELP,
    HttpLimits,
)
from kvatlas.keys import (
    DEFAULT_CHUNK_SIZE,
    SCHEMES,
    KeyScheme,
    check_cache_salt,
    check_wire_model_name,
)
from kvatlas.logs import LOG_FORMATS, LOG_LEVELS

DEFAULT_PORT = 9300
MAX_INTERVAL_S = 365 * 86400.0
"""The longest timer (a year): 1e308 s, finite, crashed start-up (a heartbeat in ms) or the
snapshot and memory-trim threads (a wait past what the platform's clock holds)."""

RENAMED_FLAGS = {
    "consumer_heartbeat": "consumer_heartbeat_s",
    "emitter_retention": "emitter_retention_s",
    "max_clock_skew": "max_clock_skew_s",
}
"""Old field (flag, variable) names and their new ones: the old ones work, with a warning,
for one release (:mod:`kvatlas.config_flags`)."""


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
    consumer_heartbeat_s: float = 10.0
    snapshot_path: Path | None = None
    snapshot_interval: float = 60.0
    memory_trim_interval_s: float = TRIM_INTERVAL_S  # 0: off (runtime.MemoryTrim)
    instance_timeout: float = 30.0
    auth_token_file: Path | None = None
    node_token_file: Path | None = None
    max_query_tokens: int = 2 * 1024 * 1024
    max_batch_entries: int = 32_768
    max_body_bytes: int | None = None  # None: derived from the other limits (body_limit)
    log_level: str = "info"
    max_instances: int = 10_000
    emitter_retention_s: float = 3600.0
    max_clock_skew_s: float = 300.0
    public_metrics: bool | None = None  # None: public exactly when auth is off
    public_docs: bool | None = None
    fragment_weight: float = DEFAULT_FRAGMENT_WEIGHT
    kv_events_subscribe: str | None = None
    kv_events_bind: str | None = None
    kv_events_replay: str | None = None
    kv_events_max_engines_per_endpoint: int = 1
    kv_events_topic_prefix: str = "kv@"
    kv_events_model: str | None = None
    kv_events_max_blocks: int = DEFAULT_MAX_BLOCKS
    kv_events_max_message_bytes: int | None = None  # None: derived (largest_message_bytes)
    kv_events_publish: str | None = None
    kv_events_replay_bind: str | None = None
    kv_events_replay_size: int = 10_000
    kv_events_publish_encoding: str = DEFAULT_ENCODING
    kv_events_publish_salts: str | None = None
    kv_events_curve_certificate: Path | None = None
    kv_events_curve_clients: Path | None = None
    kv_events_publish_unauthenticated: bool = False
    log_format: str = "json"
    access_log: bool = False
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_max_connections: int | None = None  # None: below the file limit (http_guard)
    eviction_policy: str = DEFAULT_EVICTION_POLICY.value
    cache_command_lease_s: float = 30.0

    def __post_init__(self) -> None:
        KeyScheme(self.hash_scheme, self.chunk_size)  # validates both
        self.http_limits  # noqa: B018 - validates the three --http-* limits
        if self.blend_probe_stride < 1:
            raise ValueError("--blend-probe-stride must be >= 1")
        if self.event_transport not in EVENT_TRANSPORTS:
            raise ValueError(f"--event-transport must be one of {', '.join(EVENT_TRANSPORTS)}")
        if self.event_transport == "redis" and not self.redis_url:
            raise ValueError("--event-transport redis needs --redis-url")
        for name in ("max_query_tokens", "max_batch_entries", "max_instances", "port"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        check_port("--port", self.port)
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be >= 1")
        if not 0 <= self.memory_trim_interval_s <= MAX_INTERVAL_S:
            raise ValueError(
                f"--memory-trim-interval-s must be in [0, {MAX_INTERVAL_S:,.0f}] seconds (0: off)"
            )
        checked_weight("--fragment-weight", self.fragment_weight)
        if self.snapshot_path is not None and Path(self.snapshot_path).is_dir():
            raise ValueError(
                f"--snapshot-path {self.snapshot_path} is a directory: name the snapshot file "
                f"in it (e.g. {Path(self.snapshot_path) / 'directory.snap'})"
            )
        for name in (
            "snapshot_interval",
            "instance_timeout",
            "emitter_retention_s",
            "consumer_heartbeat_s",
            "max_clock_skew_s",
            "cache_command_lease_s",
        ):
            if not 0 < getattr(self, name) <= MAX_INTERVAL_S:  # NaN too
                raise ValueError(
                    f"--{name.replace('_', '-')} must be in (0, {MAX_INTERVAL_S:,.0f}] seconds"
                )
        self._check_kv_events()
        check_choices(self, _CHOICES)  # the rest (a variable's: argparse checks a flag's only)

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
            check_wire_model_name(self.kv_events_model)
        if self.kv_events_publish_encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-publish-encoding must be one of {', '.join(ENCODINGS)}")
        for salt in self.kv_events_salts or ():
            check_cache_salt(salt)
        StreamExposure.choose(
            None, frozenset(), self.kv_events_curve_certificate, self.kv_events_curve_clients
        )  # the pair's rule; the salts' default needs the token file (the service's)
        self.node_bearer()  # an unreadable, exposed or short token file: refused now

    @property
    def kv_events_endpoints(self) -> tuple[str, ...]:
        """``--kv-events-subscribe``, split at commas."""
        return _endpoints(self.kv_events_subscribe)

    @property
    def kv_events_salts(self) -> tuple[str, ...] | None:
        """``--kv-events-publish-salts``: ``None`` when not given; an empty item is the
        unsalted namespace (``--kv-events-publish-salts ,tenant-a``)."""
        if self.kv_events_publish_salts is None:
            return None
        return tuple(s.strip() for s in self.kv_events_publish_salts.split(","))

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
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.http_header_timeout_s, self.http_body_timeout_s, self.http_max_connections
        )

    @property
    def max_lookup_keys(self) -> int:
        """Most keys in a keys-form lookup: the chunks of a ``--max-query-tokens`` query."""
        return -(-self.max_query_tokens // self.chunk_size)

    @property
    def route_bodies(self) -> RouteBodies:
        """The largest legitimate body of each kind of route, under this config."""
        return RouteBodies.of(
            max_query_tokens=self.max_query_tokens,
            max_lookup_keys=self.max_lookup_keys,
            max_instances=self.max_instances,
            max_batch_entries=self.max_batch_entries,
            chunk_size=self.chunk_size,
            max_body_bytes=self.max_body_bytes,
        )

    @property
    def metrics_public(self) -> bool:
        return public_unless_auth(self.auth_token_file is not None, self.public_metrics)

    @property
    def docs_public(self) -> bool:
        return public_unless_auth(self.auth_token_file is not None, self.public_docs)

    def node_bearer(self) -> str | None:
        """The token sent to MP servers with cache-control commands (``--node-token-file``)."""
        return read_secret(None, self.node_token_file, "--node-token")

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
    "consumer_heartbeat_s": "seconds: a replica's consumer shows itself to Redis several times per "
    "interval; start-up refuses a group whose consumer is seen again within it (a live twin) "
    "and takes over one idle past it (a crashed replica's)",
    "snapshot_path": "durable directory snapshot file (restored at start-up)",
    "snapshot_interval": "seconds between periodic snapshots",
    "memory_trim_interval_s": "seconds between malloc_trim calls handing the C allocator's free "
    "pages back to the kernel (0: never; docs/coordinator.md, process settings)",
    "instance_timeout": "seconds without heartbeat before an instance's L1 is fenced",
    "auth_token_file": "JSON token file enabling bearer-token auth (docs/security.md)",
    "node_token_file": (
        "file holding the bearer token sent to MP servers with cache-control commands (a "
        "kvatlas node with --auth-token-file: one of its admin tokens; not set: none)"
    ),
    "max_query_tokens": "largest lookup / blend-lookup query, in tokens",
    "max_batch_entries": "most entries in one POST /events body",
    "max_body_bytes": "ceiling on every request body, in bytes (each route's own limit is its "
    "largest legitimate body, derived from the limits above and --chunk-size; "
    "docs/coordinator.md)",
    "http_header_timeout_s": HEADER_TIMEOUT_HELP,
    "http_body_timeout_s": BODY_TIMEOUT_HELP,
    "http_max_connections": MAX_CONNECTIONS_HELP,
    "log_level": "log level",
    "log_format": "log lines as JSON objects (json) or plain text for humans (text)",
    "access_log": "log one line per HTTP request",
    "max_instances": "most registered instances, and most emitters the directory tracks",
    "emitter_retention_s": "seconds after which an unregistered, silent emitter is forgotten "
    "(its cursor and metric series)",
    "max_clock_skew_s": "seconds an emitter's clock may run ahead of this one: a batch whose "
    "incarnation (a start time in ns) lies further ahead is refused (docs/security.md)",
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
    "kv_events_publish_salts": "cache salts whose node placements are published, comma-separated "
    "(an empty item: the unsalted namespace); default: the unsalted one unless a token is bound "
    "to it, never a bound tenant's",
    "kv_events_curve_certificate": "zmq.auth secret certificate: the published stream and its "
    "replay socket become CurveZMQ servers (with --kv-events-curve-clients)",
    "kv_events_curve_clients": "directory of the routers' zmq.auth public certificates allowed to "
    "subscribe and replay",
    "kv_events_publish_unauthenticated": "with auth on, allow the published stream beyond "
    "loopback without CurveZMQ (it carries prompts' token ids)",
    "kv_events_publish_encoding": "vllm (exactly what vLLM emits: the batch an array, events maps "
    "tagged by type), array (older vLLM releases: every struct an array) or map (the batch a map "
    "too; no vLLM release emits it)",
    "eviction_policy": "fleet eviction per salt over its quota: lru (LMCache's: a fifth of the salt's "
    "keys, least recently used first) or value (least reuse per byte first, down to the limit); "
    'docs/cache-control.md, "Fleet eviction"',
    "cache_command_lease_s": "seconds a replica holds a cache-control command (and the fleet "
    "eviction pass) without renewing it; another replica takes it over after that (redis "
    'transport: pins, quotas and commands are in Redis; docs/cache-control.md, "Replicas")',
}


_CHOICES = {
    "hash_scheme": SCHEMES,
    "event_transport": EVENT_TRANSPORTS,
    "log_level": LOG_LEVELS,
    "log_format": LOG_FORMATS,
    "kv_events_publish_encoding": ENCODINGS,
    "eviction_policy": EVICTION_POLICIES,
}


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    only: Collection[str] | None = None,
) -> None:
    """The coordinator's flags (``only``: some of them, for a command hosting a replica)."""
    add_dataclass_arguments(
        parser, CoordinatorConfig, _HELP, _CHOICES, renamed=RENAMED_FLAGS, only=only
    )


def config_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    only: Collection[str] | None = None,
) -> CoordinatorConfig:
    """``only``: the fields read from ``args`` and the environment (the others: defaults)."""
    return dataclass_from_args(CoordinatorConfig, args, environ, RENAMED_FLAGS, only)


def parse_config(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    parser = FlagParser(prog="kvatlas coordinator", exit_on_error=False)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as exc:  # a value outside a flag's choices, say
        raise ValueError(str(exc)) from None
    return config_from_args(args, environ)
