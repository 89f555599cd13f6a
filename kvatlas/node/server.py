"""``kvatlas node``: a cache node process — L1/L2, peer L1 and engine API over HTTP, events to
the coordinator, fleet blend lookups — built from :class:`NodeConfig`.

The listeners are bound before any start-up work: ``--host/--port`` (peer API, and the engine
API unless ``--engine-port`` gives it a listener of its own). Secrets come from files or the
environment (``docs/security.md``)."""

from __future__ import annotations

import logging
from typing import Any

from kvatlas.asgi_thread import bind_listener, serve
from kvatlas.client import (
    BlendCoordinatorClient,
    CoordinatorClient,
    CoordinatorError,
    EventSink,
    HttpTransport,
    RedisStreamTransport,
    Transport,
)
from kvatlas.directory import warm_up_kernels
from kvatlas.errors import Conflict
from kvatlas.keys import KeySchemeMismatch
from kvatlas.logs import configure_logging
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.fleet_view import HttpFleetView
from kvatlas.node.http_api import create_node_app
from kvatlas.node.inventory import ResyncDriver
from kvatlas.node.l2 import FsL2, L2Backend, RedisL2, instance_dir
from kvatlas.web import is_loopback

log = logging.getLogger(__name__)


class TransportMismatch(Conflict):
    """The node would report events where its coordinator does not read them."""


def check_coordinator_compatible(config: NodeConfig, health: dict[str, Any]) -> None:
    """Compare this node's configuration with the coordinator's ``/healthz`` (``docs/node.md``).

    Refuses (raises) on a key scheme, chunk size or, for a reporting node, event transport
    mismatch; warns when the node answers blend lookups but the coordinator has them off.
    """
    config.scheme.check_compatible(str(health.get("key_scheme")), int(health.get("chunk_size", -1)))
    if not config.fleet_enabled:
        return
    theirs = health.get("event_transport")
    if theirs is not None and theirs != config.event_transport:
        raise TransportMismatch(
            f"event transport mismatch: this node uses --event-transport "
            f"{config.event_transport}, the coordinator at {config.coordinator_url} uses "
            f"--event-transport {theirs}; it would never see this node's chunks"
        )
    stream = health.get("event_stream")
    if config.event_transport == "redis" and stream is not None and stream != config.event_stream:
        raise TransportMismatch(
            f"event stream mismatch: this node writes --event-stream {config.event_stream}, "
            f"the coordinator at {config.coordinator_url} reads --event-stream {stream}; "
            "it would never see this node's chunks"
        )
    if config.enable_blend_lookup and health.get("blend_lookup") is False:
        log.warning(
            "blend lookup mismatch: this node has --enable-blend-lookup on, the coordinator at "
            "%s has it off; every fleet leg of a blend lookup will answer empty",
            config.coordinator_url,
        )


class NodeProcess:
    """Everything one node process owns, wired from its config (and torn down in reverse)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.coordinator: CoordinatorClient | None = None
        self.sink: EventSink | None = None
        fleet: HttpFleetView | None = None
        matcher: BlendCoordinatorClient | None = None
        instance_id = config.instance_id or None
        advertised = config.advertised_url or f"http://{config.host}:{config.port}"
        token = config.coordinator_bearer()
        if config.coordinator_url:
            self.coordinator = CoordinatorClient(config.coordinator_url, token=token)
            try:
                check_coordinator_compatible(config, self.coordinator.health())
            except Conflict:
                self.coordinator.close()
                raise
            instance_id = self.coordinator.register(
                instance_id, ip=config.host, http_port=config.port, p2p_advertised_url=advertised,
                metadata={"model_name": config.model_name, "kv_rank": config.kv_rank},
            )  # fmt: skip
            self.coordinator.start_heartbeat()
        config.warn_if_half_configured()
        if config.fleet_enabled and self.coordinator is not None:
            transport: Transport
            if config.event_transport == "redis":
                transport = RedisStreamTransport(
                    config.redis_url, config.event_stream, maxlen=config.stream_max_len
                )
            else:
                transport = HttpTransport(config.coordinator_url, token=token)
            assert instance_id is not None
            self.sink = EventSink(instance_id, transport)
            fleet = HttpFleetView(
                self.coordinator,
                layout=config.layout,
                peer_deadline=config.peer_fetch_deadline,
                refresh_interval=config.fleet_refresh_interval,
                peer_token=config.peer_bearer(),
            )
            matcher = BlendCoordinatorClient(
                config.coordinator_url,
                request_timeout=config.coordinator_blend_timeout,
                token=token,
            )
        l2: L2Backend | None = None
        if config.l2 == "fs" and config.l2_shared:
            l2 = FsL2(config.l2_path, "fs-shared", shared=True)
        elif config.l2 == "fs":
            l2 = FsL2(instance_dir(config.l2_path, instance_id or "node"))
        elif config.l2 == "redis":
            l2 = RedisL2(config.l2_redis_url)
        self.node = CacheNode(
            config,
            instance_id=instance_id,
            l2=l2,
            sink=self.sink,
            fleet=fleet,
            fleet_matcher=matcher,
        )
        self.app = create_node_app(self.node, auth=config.auth())
        self.resync = self._start_resync()

    def _start_resync(self) -> ResyncDriver | None:
        """Digest exchanges: now (the node just registered), every ``--digest-interval``, after
        every re-registration, on the coordinator's hint and after the sink lost batches."""
        coordinator, sink = self.coordinator, self.sink
        if coordinator is None or sink is None:
            return None

        def lost() -> int:
            stats = sink.stats()
            return stats.dropped_batches + stats.quarantined_batches

        driver = self.node.resync_driver(
            coordinator.exchange_digests,
            interval=self.config.digest_interval,
            settle=lambda: sink.flush(timeout=5.0),
            lost=lost,
        )
        if driver is not None:
            coordinator.on_resync = driver.wanted.set
            driver.wanted.set()
            driver.start()
        return driver

    def close(self) -> None:
        if self.resync is not None:
            self.resync.stop()
        self.node.close()
        if self.sink is not None:
            self.sink.close()
        if self.coordinator is not None:
            try:
                self.coordinator.deregister()
            except CoordinatorError as exc:
                log.warning("deregistration failed: %s", exc)
            self.coordinator.close()


def listeners(config: NodeConfig) -> list[tuple[str, int, str]]:
    """``(host, port, what it serves)`` of each listener the node binds."""
    if config.engine_port is None:
        return [(config.host, config.port, "peer and engine APIs")]
    engine_host = config.engine_host or config.host
    return [(config.host, config.port, "peer API"), (engine_host, config.engine_port, "engine API")]


def announce_security(config: NodeConfig) -> None:
    """Log how the node's APIs are protected; WARNING for a routable address without auth."""
    if config.auth_token_file is not None:
        log.info("auth enabled (tokens from %s)", config.auth_token_file)
        return
    for host, port, what in listeners(config):
        if is_loopback(host):
            log.info("auth disabled: %s bound to loopback %s:%d only", what, host, port)
        else:
            log.warning(
                "auth disabled and the %s bound to %s:%d: anyone who can reach this port can "
                "read and store every tenant's KV; use --auth-token-file",
                what, host, port,
            )  # fmt: skip


def run_node(config: NodeConfig) -> int:
    configure_logging(config.log_level)
    announce_security(config)
    try:
        socks = [bind_listener(host, port) for host, port, _ in listeners(config)]
    except OSError as exc:
        log.error("refusing to start: %s", exc)
        return 2
    warm_up_kernels()
    try:
        process = NodeProcess(config)
    except (KeySchemeMismatch, TransportMismatch, CoordinatorError) as exc:
        log.error("refusing to start: %s", exc)
        for sock in socks:
            sock.close()
        return 2
    log.info(
        "kvatlas node %s on %s (fleet %s, l2 %s)",
        process.node.instance_id,
        ", ".join(f"http://{h}:{p} ({what})" for h, p, what in listeners(config)),
        "on" if config.fleet_enabled else "off", config.l2,
    )  # fmt: skip
    kwargs: dict[str, Any] = {"log_level": config.log_level}
    try:
        serve(process.app, host=config.host, port=config.port, sock=socks, **kwargs)
    finally:
        process.close()
    return 0
