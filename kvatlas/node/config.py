"""Cache-node configuration: ``kvatlas node`` flags, each also ``KVATLAS_<NAME>``, each
described by ``kvatlas node --help`` (the texts: :mod:`kvatlas.node.config_help`; flags and
gating: ``docs/node.md``).

Precedence: command line > environment > default. A flag that names the same concept as a
coordinator flag has the same name (``--enable-blend-lookup``, ``--event-transport``).

Gating rule: fleet matching needs a coordinator URL **and** event reporting. A URL
without event reporting is treated as "not configured" with a warning: the coordinator would
hold none of this node's state, and every fleet query would be a wasted round trip.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvatlas.auth import TokenAuth, public_unless_auth, read_secret
from kvatlas.checks import check_http_url, check_port
from kvatlas.config_flags import (
    add_dataclass_arguments,
    check_choices,
    dataclass_from_args,
    env_name,
    warn_renamed,
)
from kvatlas.events import EVENT_TRANSPORTS
from kvatlas.http_limits import HttpLimits
from kvatlas.keys import DEFAULT_CHUNK_SIZE, SCHEMES, KeyScheme, check_instance_id, pack_kv_rank
from kvatlas.logs import LOG_FORMATS, LOG_LEVELS
from kvatlas.node.config_help import HELP
from kvatlas.node.hf_config import LAYOUT_DEFAULTS, LAYOUT_SHAPE, resolve_layout
from kvatlas.node.kv_dtype import KV_DTYPES
from kvatlas.node.kv_layout import ROPE_STYLES, KVLayout
from kvatlas.node.peer_credentials import PeerSecret

log = logging.getLogger(__name__)

L2_KINDS = ("fs", "redis", "none")
L2_WRITE_POLICIES = ("through", "evict")
RENAMED_FLAGS = {
    "enable_blend": "enable_blend_lookup",
    "digest_interval": "digest_interval_s",
    "heartbeat_interval": "heartbeat_interval_s",
    "peer_fetch_deadline": "peer_fetch_deadline_s",
    "fleet_refresh_interval": "fleet_refresh_interval_s",
    "l2_redis_sweep_interval": "l2_redis_sweep_interval_s",
    "coordinator_retry_max": "coordinator_retry_max_s",
}
"""Old field (flag, variable) names and their new ones: the old ones work, with a warning,
for one release (:mod:`kvatlas.config_flags`)."""
DEFAULT_L2_MAX_BYTES = 64 << 30
"""A cap by default, because a write-through L2 that nothing bounds fills its disk; 64 GiB is
about 2,000 chunks of an 8B model at 256 tokens (fp16): worth having, small beside a data
disk. ``--l2-max-bytes 0`` lifts it (for a volume bounded otherwise)."""


@dataclass(frozen=True)
class NodeConfig:
    model_name: str = "model"
    # The layout fields: None = not given; filled in by __post_init__ from --hf-config,
    # else from LAYOUT_DEFAULTS (after construction they always hold the resolved values).
    hf_config: Path | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    dtype: str | None = None
    rope_style: str | None = None
    rotary_dim: int | None = None  # 0 = head_dim
    rope_theta: float | None = None
    hash_scheme: str = "blake3"
    world_size: int = 1
    rank: int = 0
    instance_id: str | None = None
    engine_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 9400
    advertised_url: str | None = None
    l1_bytes: int = 1 << 30
    l2: str = "fs"
    l2_path: Path = field(default_factory=lambda: default_l2_path())
    l2_redis_url: str | None = None
    l2_write: str = "through"
    l2_shared: bool = False  # --l2 fs on a directory every node mounts: a fleet-wide pool
    coordinator_url: str | None = None
    coordinator_event_reporting: bool = False
    coordinator_blend_timeout: float = 1.0
    coordinator_token: str | None = None
    coordinator_token_file: Path | None = None
    event_transport: str = "http"
    redis_url: str | None = None
    event_stream: str = "kvatlas:events"
    stream_max_len: int = 10_000_000
    digest_interval_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    enable_blend_lookup: bool = True
    allow_trim: bool = False
    prefer_cheaper: bool = True
    token_cache_chunks: int = 100_000
    auth_token_file: Path | None = None
    engine_host: str | None = None
    engine_port: int | None = None
    peer_token: str | None = None
    peer_token_file: Path | None = None
    max_query_tokens: int = 128 * 1024
    max_body_bytes: int | None = None  # None: derived from the layout (max_store_bytes)
    tracker_memory_bytes: int = 64 * 1024 * 1024
    peer_fetch_deadline_s: float = 2.0
    fleet_refresh_interval_s: float = 10.0
    pin_refresh_interval_s: float = 5.0
    public_metrics: bool | None = None  # None: public exactly when auth is off
    public_docs: bool | None = None
    l2_max_bytes: int = DEFAULT_L2_MAX_BYTES  # private fs L2 only; 0 = no cap
    l2_redis_ttl: int = 0  # seconds; 0 = values never expire
    l2_redis_sweep_interval_s: float = 30.0
    coordinator_retry_max_s: float = 30.0
    log_level: str = "info"
    log_format: str = "json"
    access_log: bool = False
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_max_connections: int | None = None  # None: below the file limit (http_guard)

    def __post_init__(self) -> None:
        flags = {name: getattr(self, name) for name in LAYOUT_DEFAULTS}
        for name, value in resolve_layout(flags, self.hf_config, self.world_size).items():
            object.__setattr__(self, name, value)
        self.layout  # noqa: B018 - validates the KV layout fields
        self.http_limits  # noqa: B018 - validates the three --http-* limits
        KeyScheme(self.hash_scheme, self.chunk_size)
        pack_kv_rank(self.world_size, self.rank, self.world_size, self.rank)
        if self.instance_id:
            check_instance_id(self.instance_id)
        if self.coordinator_url:
            check_http_url(self.coordinator_url, "--coordinator-url")
        if self.engine_id:
            try:
                check_instance_id(self.engine_id)
            except ValueError as exc:
                raise ValueError(f"--engine-id: {exc}") from None
            if self.engine_id == self.instance_id:
                raise ValueError("--engine-id names the engine this node serves, not the node")
            if not self.coordinator_url:
                raise ValueError("--engine-id needs --coordinator-url (it is said at registration)")
        if self.l2 not in L2_KINDS:
            raise ValueError(f"--l2 must be one of {', '.join(L2_KINDS)}")
        if self.l2 == "redis" and not self.l2_redis_url:
            raise ValueError("--l2 redis needs --l2-redis-url")
        if self.l2_write not in L2_WRITE_POLICIES:
            raise ValueError(f"--l2-write must be one of {', '.join(L2_WRITE_POLICIES)}")
        if self.event_transport not in EVENT_TRANSPORTS:
            raise ValueError(f"--event-transport must be one of {', '.join(EVENT_TRANSPORTS)}")
        if (
            self.event_transport == "redis"
            and self.coordinator_event_reporting
            and not self.redis_url
        ):
            raise ValueError("--event-transport redis needs --redis-url")
        if self.l1_bytes < 0 or self.token_cache_chunks < 0:
            raise ValueError("--l1-bytes and --token-cache-chunks must be >= 0")
        if not 0 < self.coordinator_blend_timeout < 3600:
            raise ValueError("--coordinator-blend-timeout must be in (0, 3600) seconds")
        check_port("--port", self.port, 0)
        if self.engine_port is not None and not (
            0 < self.engine_port <= 65535 and self.engine_port != self.port
        ):
            raise ValueError("--engine-port must be in [1, 65535] and differ from --port")
        if self.engine_host and self.engine_port is None:
            raise ValueError("--engine-host needs --engine-port (a listener of its own)")
        for name in ("max_query_tokens", "tracker_memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_body_bytes == 0:  # the old "not set"; accepted for one release
            warn_renamed("--max-body-bytes 0", "no --max-body-bytes (derived from the layout)")
            object.__setattr__(self, "max_body_bytes", None)
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be >= 1 (not set: derived from the layout)")
        # a token and its file both given, a short token, an unreadable, exposed or short
        # token file: refused now (auth.read_secret)
        self.coordinator_bearer()
        self.peer_bearer()
        self.auth()
        if self.stream_max_len < 1:
            raise ValueError("--stream-max-len must be >= 1")
        if not 0 < self.digest_interval_s < 86400:
            raise ValueError("--digest-interval-s must be in (0, 86400) seconds")
        if not 0 < self.peer_fetch_deadline_s < 3600:
            raise ValueError("--peer-fetch-deadline-s must be in (0, 3600) seconds")
        if self.l2_max_bytes < 0 or self.l2_redis_ttl < 0:
            raise ValueError("--l2-max-bytes and --l2-redis-ttl must be >= 0 (0 = none)")
        for name in (
            "l2_redis_sweep_interval_s",
            "coordinator_retry_max_s",
            "heartbeat_interval_s",
            "pin_refresh_interval_s",
        ):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 3600] seconds")
        if not 0 <= self.fleet_refresh_interval_s <= 3600:  # (0: at every peer ask; inf: never)
            raise ValueError("--fleet-refresh-interval-s must be in [0, 3600] seconds (0: always)")
        check_choices(self, _CHOICES)  # the rest (a variable's: argparse checks a flag's only)

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.http_header_timeout_s, self.http_body_timeout_s, self.http_max_connections
        )

    @property
    def layout(self) -> KVLayout:
        assert self.num_layers is not None and self.num_kv_heads is not None
        assert self.head_dim is not None and self.dtype is not None
        assert self.rope_style is not None and self.rope_theta is not None
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            chunk_size=self.chunk_size,
            dtype=self.dtype,
            rotary_dim=self.rotary_dim or None,
            rope_style=self.rope_style,
            rope_theta=self.rope_theta,
        )

    @property
    def max_call_bytes(self) -> int:
        """Largest engine call without KV (lookup, retrieve, blend-*): the tokens of a
        ``max_query_tokens`` request as uint32, a segment (~256 B) per chunk, 64 KiB of fields."""
        return (
            self.max_query_tokens * 4 + self.max_query_tokens // self.chunk_size * 256 + (64 * 1024)
        )

    @property
    def max_json_call_bytes(self) -> int:
        """:attr:`max_call_bytes` of a call in JSON: the tokens' bytes as base64."""
        tokens = self.max_query_tokens * 4
        return self.max_call_bytes - tokens + base64_chars(tokens)

    @property
    def max_store_bytes(self) -> int:
        """Largest ``/engine/store`` body: ``--max-body-bytes``, or by default one request's
        KV for ``max_query_tokens`` tokens (whole chunks) on top of :attr:`max_call_bytes`."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return self.max_call_bytes + self._max_kv_bytes

    @property
    def max_json_store_bytes(self) -> int:
        """:attr:`max_store_bytes` of a store in JSON: the KV as base64 on top of
        :attr:`max_json_call_bytes` (``--max-body-bytes`` bounds both formats alike)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return self.max_json_call_bytes + base64_chars(self._max_kv_bytes)

    @property
    def _max_kv_bytes(self) -> int:
        """One request's KV: ``max_query_tokens`` tokens in whole chunks."""
        return -(-self.max_query_tokens // self.chunk_size) * self.layout.chunk_bytes

    @property
    def metrics_public(self) -> bool:
        """Whether ``/metrics`` needs no token (else an admin token), as on the coordinator."""
        return public_unless_auth(self.auth_token_file is not None, self.public_metrics)

    @property
    def docs_public(self) -> bool:
        """Whether ``/docs`` and ``/openapi.json`` need no token (else any valid one)."""
        return public_unless_auth(self.auth_token_file is not None, self.public_docs)

    def auth(self) -> TokenAuth | None:
        """The engine/peer API's tokens (``--auth-token-file``; ``None`` = no auth), by the
        coordinator's rule (:meth:`~kvatlas.auth.TokenAuth.from_file`)."""
        if self.auth_token_file is None:
            return None
        return TokenAuth.from_file(self.auth_token_file)

    def coordinator_bearer(self) -> str | None:
        """The coordinator token: ``--coordinator-token-file``, else the flag or environment."""
        return read_secret(
            self.coordinator_token, self.coordinator_token_file, "--coordinator-token"
        )

    def peer_bearer(self) -> str | None:
        """The fleet's peer secret (``--peer-token-file``, the flag or the environment)."""
        return read_secret(self.peer_token, self.peer_token_file, "--peer-token")

    def peer_secret(self) -> PeerSecret | None:
        """What this node derives its peer credentials and URL signature from (``None``:
        it sends no credential and signs nothing; ``kvatlas/node/peer_credentials.py``)."""
        secret = self.peer_bearer()
        return PeerSecret(secret) if secret else None

    @property
    def scheme(self) -> KeyScheme:
        return KeyScheme(self.hash_scheme, self.chunk_size)

    @property
    def kv_rank(self) -> int:
        return pack_kv_rank(self.world_size, self.rank, self.world_size, self.rank)

    @property
    def fleet_enabled(self) -> bool:
        """The gating rule: a coordinator URL alone is not enough (see module docstring)."""
        return bool(self.coordinator_url) and self.coordinator_event_reporting


def base64_chars(n: int) -> int:
    """Characters of ``n`` bytes in base64 (how a JSON engine call carries bytes)."""
    return 4 * -(-n // 3)


def default_l2_path(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user cache directory: ``$XDG_CACHE_HOME/kvatlas/l2``, else
    ``~/.cache/kvatlas/l2``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvatlas" / "l2"


_CHOICES = {
    "dtype": KV_DTYPES,
    "rope_style": ROPE_STYLES,
    "hash_scheme": SCHEMES,
    "l2": L2_KINDS,
    "l2_write": L2_WRITE_POLICIES,
    "event_transport": EVENT_TRANSPORTS,
    "log_level": LOG_LEVELS,
    "log_format": LOG_FORMATS,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every :class:`NodeConfig` field as a flag, and the hidden old spellings
    (:data:`RENAMED_FLAGS`)."""
    add_dataclass_arguments(parser, NodeConfig, HELP, _CHOICES, renamed=RENAMED_FLAGS)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> NodeConfig:
    """Flags over ``KVATLAS_*`` over defaults (an old spelling's variable counts, with a
    warning, when the new one is not set)."""
    env = os.environ if environ is None else environ
    for name in ("coordinator_token", "peer_token"):
        if getattr(args, name, None):
            log.warning(
                "--%s on the command line shows in the process list; use --%s-file or %s",
                name.replace("_", "-"), name.replace("_", "-"), env_name(name),
            )  # fmt: skip

    def given(name: str) -> bool:
        return getattr(args, name, None) is not None or env_name(name) in env

    if not given("hf_config"):
        missing = [n for n in LAYOUT_SHAPE if not given(n)]
        if missing:  # a guessed shape stores KV no engine can use: refuse, never guess
            raise ValueError(
                "the model's KV layout is not set (no " + ", ".join(
                    "--" + n.replace("_", "-") for n in missing) + "): give --hf-config with "
                "the model's Hugging Face config.json, or --num-layers, --num-kv-heads and "
                "--head-dim"
            )  # fmt: skip
    return dataclass_from_args(NodeConfig, args, env, RENAMED_FLAGS)
