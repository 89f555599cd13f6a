"""Cache-node configuration: ``kvatlas node`` flags, each also ``KVATLAS_<NAME>``.

Gating rule (node.md §2): fleet matching needs a coordinator URL **and** event reporting. A URL
without event reporting is treated as "not configured" with a warning: the coordinator would
hold none of this node's state, and every fleet query would be a wasted round trip.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvatlas.config_flags import add_dataclass_arguments, dataclass_from_args
from kvatlas.keys import SCHEMES, KeyScheme, pack_kv_rank
from kvatlas.node.kv_layout import KVLayout

log = logging.getLogger("kvatlas.node")

L2_KINDS = ("fs", "redis", "none")
L2_WRITE_POLICIES = ("through", "evict")
EVENT_TRANSPORTS = ("http", "redis")


@dataclass(frozen=True)
class NodeConfig:
    model_name: str = "model"
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    chunk_size: int = 256
    dtype: str = "float16"
    rope_style: str = "neox"
    rotary_dim: int = 0  # 0 = head_dim
    rope_theta: float = 10000.0
    hash_scheme: str = "blake3"
    world_size: int = 1
    rank: int = 0
    instance_id: str = ""
    host: str = "127.0.0.1"
    port: int = 9400
    advertised_url: str = ""
    l1_bytes: int = 1 << 30
    l2: str = "fs"
    l2_path: Path = Path("kvatlas-l2")
    l2_redis_url: str = ""
    l2_write: str = "through"
    l2_shared: bool = False  # --l2 fs on a directory every node mounts: a fleet-wide pool
    coordinator_url: str = ""
    coordinator_event_reporting: bool = False
    coordinator_blend_timeout: float = 1.0
    coordinator_token: str = ""
    event_transport: str = "http"
    redis_url: str = ""
    event_stream: str = "kvatlas:events"
    enable_blend: bool = True
    allow_trim: bool = False
    prefer_cheaper: bool = True
    token_cache_chunks: int = 100_000
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.layout  # noqa: B018 - validates the KV layout fields
        KeyScheme(self.hash_scheme, self.chunk_size)
        pack_kv_rank(self.world_size, self.rank, self.world_size, self.rank)
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
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")

    @property
    def layout(self) -> KVLayout:
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
    def scheme(self) -> KeyScheme:
        return KeyScheme(self.hash_scheme, self.chunk_size)

    @property
    def kv_rank(self) -> int:
        return pack_kv_rank(self.world_size, self.rank, self.world_size, self.rank)

    @property
    def fleet_enabled(self) -> bool:
        """The gating rule: a coordinator URL alone is not enough (see module docstring)."""
        return bool(self.coordinator_url) and self.coordinator_event_reporting

    def warn_if_half_configured(self) -> None:
        if self.coordinator_url and not self.coordinator_event_reporting:
            log.warning(
                "coordinator URL %s given without --coordinator-event-reporting: fleet lookup "
                "is treated as not configured (the coordinator would hold none of this node's "
                "chunks); matching locally only",
                self.coordinator_url,
            )


_HELP = {
    "hash_scheme": f"key scheme ({' or '.join(SCHEMES)})",
    "l2": f"L2 tier: {', '.join(L2_KINDS)}",
    "l2_write": "write L2 on every store (through) or when L1 evicts (evict)",
    "coordinator_event_reporting": "report cache events (required for fleet matching)",
    "coordinator_blend_timeout": "seconds a blend lookup waits for the fleet leg",
    "event_transport": f"how events travel: {', '.join(EVENT_TRANSPORTS)}",
    "advertised_url": "URL peers use for this node's L1 (default http://host:port)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, NodeConfig, _HELP)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> NodeConfig:
    return dataclass_from_args(NodeConfig, args, environ)
