"""``kvatlas node``: a cache node process — L1/L2, peer L1 and engine API over HTTP, events to
the coordinator, fleet blend lookups — built from :class:`NodeConfig`.

The listeners are bound before any start-up work: ``--host/--port`` (peer API, and the engine
API unless ``--engine-port`` gives it a listener of its own). Secrets come from files or the
environment (``docs/security.md``).

Start order does not matter: a coordinator that cannot be reached at start-up is retried in
the background (:class:`~kvatlas.node.registration.Registrar`) while the node serves its local
tiers; events queue in the sink's outbox meanwhile. The compatibility check still runs at
first contact, and a mismatch then still stops the node (exit 2). After a late registration
the node re-reports what it holds
(:meth:`~kvatlas.node.cache_node.CacheNode.report_inventory`)."""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvatlas.api import HealthReply
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
from kvatlas.coordinator.runtime import freeze_long_lived
from kvatlas.directory import warm_up_kernels
from kvatlas.errors import Conflict, KvatlasError
from kvatlas.keys import KeySchemeMismatch, ObjectKey, warm_up_mm_values
from kvatlas.logs import configure_logging, uvicorn_log_options
from kvatlas.node.cache_control import key_of
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import DEFAULT_L2_MAX_BYTES, NodeConfig
from kvatlas.node.fleet_view import HttpFleetView
from kvatlas.node.http_api import create_node_app
from kvatlas.node.inventory import ResyncDriver
from kvatlas.node.l2 import FsL2, L2Backend, RedisL2, instance_dir
from kvatlas.node.metrics import new_boot, value_report
from kvatlas.node.pins import PinFollower
from kvatlas.node.registration import (
    Registrar,
    TransportMismatch,
    check_coordinator_compatible,
    follow_coordinator_format,
    is_refusal,
    register,
)
from kvatlas.web import is_loopback

__all__ = [
    "NodeProcess",
    "Registrar",
    "TransportMismatch",
    "announce_security",
    "check_coordinator_compatible",
    "follow_coordinator_format",
    "register",
    "run_node",
    "warn_if_shared_peer_token",
]
log = logging.getLogger(__name__)

RETRY_MAX_S = 5.0  # the longest wait between event deliveries while the receiver is down


def warn_if_half_configured(config: NodeConfig) -> None:
    """The gating rule's warning (``kvatlas/node/config.py``): a URL without reporting."""
    if config.coordinator_url and not config.coordinator_event_reporting:
        log.warning(
            "coordinator URL %s given without --coordinator-event-reporting: fleet lookup "
            "is treated as not configured (the coordinator would hold none of this node's "
            "chunks); matching locally only",
            config.coordinator_url,
        )


class NodeProcess:
    """Everything one node process owns, wired from its config (and torn down in reverse).

    A coordinator that answers at start-up is checked and registered with at once (a mismatch
    raises); one that does not is left to a :class:`Registrar` (module docstring), whose
    mismatch goes to ``on_fatal``; it starts at once, or with ``start=False`` at
    :meth:`start` (``run_node`` starts it once the server is up and handles signals)."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        on_fatal: Callable[[Conflict], object] | None = None,
        start: bool = True,
    ) -> None:
        self.config = config
        self.coordinator: CoordinatorClient | None = None
        self.registrar: Registrar | None = None
        self.sink: EventSink | None = None
        fleet: HttpFleetView | None = None
        matcher: BlendCoordinatorClient | None = None
        instance_id = config.instance_id
        token = config.coordinator_bearer()
        event_format = "msgpack"
        deferred = False
        if config.coordinator_url:
            self.coordinator = CoordinatorClient(config.coordinator_url, token=token)
            try:
                health = self.coordinator.health()
            except CoordinatorError as exc:
                if is_refusal(exc):
                    self.coordinator.close()  # it answered, and said no: not "not up yet"
                    raise
                deferred = True
                if instance_id is None:  # events and the L2 directory need an id now
                    instance_id = f"node-{uuid.uuid4().hex[:12]}"
                    log.warning(
                        "no --instance-id and the coordinator cannot assign one yet: using %s "
                        "(give a stable --instance-id so a restart finds its L2)", instance_id,
                    )  # fmt: skip
                log.warning(
                    "coordinator %s not reachable at start-up (%s): serving local tiers, "
                    "registering in the background", config.coordinator_url, exc,
                )  # fmt: skip
            else:
                if not health.states_hash_scheme:  # LMCache's coordinator: JSON events only
                    event_format = "json"
                try:
                    check_coordinator_compatible(config, health)
                    instance_id = register(self.coordinator, config, instance_id)
                except (Conflict, CoordinatorError):
                    self.coordinator.close()
                    raise
        warn_if_half_configured(config)
        transport: Transport | None = None
        if config.fleet_enabled and self.coordinator is not None:
            assert config.coordinator_url is not None  # fleet_enabled
            if config.event_transport == "redis":
                assert config.redis_url is not None  # NodeConfig refuses redis without it
                transport = RedisStreamTransport(
                    config.redis_url, config.event_stream, maxlen=config.stream_max_len,
                    token=token,
                )  # fmt: skip
            else:
                transport = HttpTransport(config.coordinator_url, fmt=event_format, token=token)
            assert instance_id is not None
            # Retry at least once per heartbeat (and per 5 s): after an outage (Redis, the
            # coordinator) the directory catches up within one heartbeat, as liveness does.
            retry_max = min(RETRY_MAX_S, config.heartbeat_interval_s)
            self.sink = EventSink(instance_id, transport, backoff_max=retry_max)
            fleet = HttpFleetView(
                self.coordinator,
                layout=config.layout,
                peer_deadline=config.peer_fetch_deadline_s,
                refresh_interval=config.fleet_refresh_interval_s,
                peer_secret=config.peer_secret(),
            )
            matcher = BlendCoordinatorClient(
                config.coordinator_url,
                request_timeout=config.coordinator_blend_timeout,
                token=token,
            )
        self.node = CacheNode(
            config,
            instance_id=instance_id,
            l2=open_l2(config, instance_id or "node"),
            sink=self.sink,
            fleet=fleet,
            fleet_matcher=matcher,
        )
        if fleet is not None:
            fleet.counters = self.node.counters  # URL refusals beside the node's counters
        self.app = create_node_app(self.node, auth=config.auth(), peer_secret=config.peer_secret())
        self.pin_follower: PinFollower | None = None
        if self.coordinator is not None:
            start_heartbeat = self._value_reporting(self.coordinator, matcher)
            if not deferred:
                start_heartbeat()
                if health.states_hash_scheme:  # LMCache's coordinator keeps no pins to read
                    self._follow_pins(self.coordinator)
        if deferred:
            assert self.coordinator is not None and instance_id is not None
            node = self.node

            coordinator, kvatlas_coordinator = self.coordinator, [False]

            def registered() -> None:
                start_heartbeat()
                node.report_inventory()
                if kvatlas_coordinator[0]:
                    self._follow_pins(coordinator)

            events = transport

            def reached(health: HealthReply) -> None:
                kvatlas_coordinator[0] = health.states_hash_scheme
                if isinstance(events, HttpTransport):
                    follow_coordinator_format(events, health)

            self.registrar = Registrar(
                self.coordinator, config, instance_id,
                on_registered=registered,
                on_fatal=on_fatal or (lambda exc: None),
                on_health=reached,
                retry_max=config.coordinator_retry_max_s,
                counters=self.node.counters,
            )  # fmt: skip
            if start:
                self.start()

        self.resync = self._start_resync(now=not deferred)

    def start(self) -> None:
        """Start reaching the coordinator in the background, if it was not up at start-up."""
        if self.registrar is not None and not self.registrar.started:
            self.registrar.start()

    def _value_reporting(
        self, coordinator: CoordinatorClient, matcher: BlendCoordinatorClient | None
    ) -> Callable[[], None]:
        """Count coordinator call failures on the node's /metrics; returns what starts the
        heartbeats (once registered), each followed by the value report (regret, hit and
        query tokens, tiers)."""
        node, boot = self.node, new_boot()
        self.node.coordinator_failures = lambda: (
            coordinator.failures + (matcher.failures if matcher is not None else 0)
        )
        return lambda: coordinator.start_heartbeat(
            self.config.heartbeat_interval_s,
            report=lambda: value_report(boot, node.counters, node.tier_gauges()),
        )

    def _follow_pins(self, coordinator: CoordinatorClient) -> None:
        """Read this node's pins every ``--pin-refresh-interval-s`` (``kvatlas.node.pins``)."""
        model = self.config.model_name

        def fetch() -> list[ObjectKey]:
            return [key_of(row.key) for row in coordinator.pins(model)]

        self.pin_follower = PinFollower(
            fetch, self.node.pins, self.config.pin_refresh_interval_s, self.node.counters
        ).start()

    def _start_resync(self, *, now: bool) -> ResyncDriver | None:
        """Digest exchanges: ``now`` (the node just registered; a deferred registration asks
        for one itself), every ``--digest-interval-s``, after every re-registration, on the
        coordinator's hint and after the sink lost batches."""
        coordinator, sink = self.coordinator, self.sink
        if coordinator is None or sink is None:
            return None

        def lost() -> int:
            stats = sink.stats()
            return stats.dropped_batches + stats.quarantined_batches

        driver = self.node.resync_driver(
            coordinator.exchange_digests,
            interval=self.config.digest_interval_s,
            settle=lambda: sink.flush(timeout=5.0),
            lost=lost,
        )
        if driver is not None:
            coordinator.on_resync = driver.wanted.set
            coordinator.on_list_all = driver.want_listing
            if now:
                driver.wanted.set()
            driver.start()
        return driver

    def close(self) -> None:
        if self.pin_follower is not None:
            self.pin_follower.stop()
        if self.resync is not None:
            self.resync.stop()
        if self.registrar is not None:
            self.registrar.stop()
        self.node.close()
        if self.sink is not None:
            self.sink.close()
        if self.coordinator is not None:
            try:
                self.coordinator.deregister()
            except CoordinatorError as exc:
                log.warning("deregistration failed: %s", exc)
            self.coordinator.close()


def open_l2(config: NodeConfig, instance_id: str) -> L2Backend | None:
    """The L2 backend ``config`` names: a shared fs pool (uncapped here), a private fs L2
    under ``--l2-path/<instance id>`` capped at ``--l2-max-bytes``, or Redis."""
    if config.l2 == "fs" and config.l2_shared:
        if config.l2_max_bytes not in (0, DEFAULT_L2_MAX_BYTES):
            log.warning(
                "--l2-max-bytes does not apply to a shared pool (--l2-shared): cap the pool "
                "where it is provisioned (a quota, a size-limited volume)"
            )
        return FsL2(config.l2_path, "fs-shared", shared=True)
    if config.l2 == "fs":
        return FsL2(instance_dir(config.l2_path, instance_id), max_bytes=config.l2_max_bytes)
    if config.l2 == "redis":
        assert config.l2_redis_url is not None  # NodeConfig refuses redis without it
        return RedisL2(
            config.l2_redis_url,
            ttl_seconds=config.l2_redis_ttl or None,
            sweep_interval=config.l2_redis_sweep_interval_s,
        )
    return None


class OnServing:
    """ASGI wrapper calling ``hook`` once the server completed start-up (lifespan): by then
    it serves and handles SIGTERM, so a background task may stop it with one."""

    def __init__(self, app: Any, hook: Callable[[], object]) -> None:
        self.app = app
        self._hook = hook

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_then_hook(message: MutableMapping[str, Any]) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                self._hook()

        await self.app(scope, receive, send_then_hook)


def stop_this_process(_exc: Conflict) -> None:
    """Ask the running server to shut down (as SIGTERM would): a mismatch found late."""
    os.kill(os.getpid(), signal.SIGTERM)


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
        warn_if_shared_peer_token(config)
        return
    if config.peer_token is not None or config.peer_token_file is not None:
        log.warning(
            "--peer-token-file without --auth-token-file: this node's calls to its peers carry "
            "its credential, but its own /peer routes check none (auth is off: any caller "
            "reads its KV); use --auth-token-file"
        )
    for host, port, what in listeners(config):
        if is_loopback(host):
            log.info("auth disabled: %s bound to loopback %s:%d only", what, host, port)
        else:
            log.warning(
                "auth disabled and the %s bound to %s:%d: anyone who can reach this port can "
                "read and store every tenant's KV; use --auth-token-file",
                what, host, port,
            )  # fmt: skip


def warn_if_shared_peer_token(config: NodeConfig) -> None:
    """The setup before per-peer credentials listed the peer secret itself as a ``peer``
    token in every node's auth file. Still accepted (nodes not yet upgraded send it), but
    then anything that captures it opens this node: warn until it is removed."""
    secret, auth = config.peer_bearer(), config.auth()
    if not secret or auth is None:
        return
    try:
        who = auth.authenticate(f"Bearer {secret}")
    except KvatlasError:
        return
    if who.may("peer"):
        log.warning(
            "%s lists the peer secret (--peer-token-file) as a token: any holder of it opens "
            "this node's /peer/kv. Nodes now send a credential derived per target; remove "
            "that entry once every node of the fleet runs this version (docs/security.md)",
            config.auth_token_file,
        )


def run_node(config: NodeConfig) -> int:
    configure_logging(config.log_level, config.log_format)
    announce_security(config)
    try:
        socks = [bind_listener(host, port) for host, port, _ in listeners(config)]
    except OSError as exc:
        log.error("refusing to start: %s", exc)
        return 2
    warm_up_kernels()
    warm_up_mm_values()  # the engine API's multimodal items (its request trackers' keys)
    try:
        process = NodeProcess(config, on_fatal=stop_this_process, start=False)
    except (KeySchemeMismatch, TransportMismatch, CoordinatorError) as exc:
        log.error("refusing to start: %s", exc)
        for sock in socks:
            sock.close()
        return 2
    log.info(
        "kvatlas node %s on %s (fleet %s, l2 %s); KV layout %d layers × %d KV heads × %d "
        "dims %s from %s",
        process.node.instance_id,
        ", ".join(f"http://{h}:{p} ({what})" for h, p, what in listeners(config)),
        "on" if config.fleet_enabled else "off",
        f"fs in {config.l2_path}" if config.l2 == "fs" else config.l2,
        config.layout.num_layers, config.layout.num_kv_heads, config.layout.head_dim,
        config.layout.dtype,
        f"--hf-config {config.hf_config}" if config.hf_config else "the layout flags",
    )  # fmt: skip
    kwargs = uvicorn_log_options(config.log_level, config.access_log)
    # what lives for the whole process (modules, compiled kernels, the app) out of the cycle
    # collector's sight, as in the coordinator (coordinator/runtime.py says why it is safe):
    # full collections, and the one at exit, no longer walk it
    freeze_long_lived()
    try:
        app = OnServing(process.app, process.start)
        serve(
            app,
            host=config.host,
            port=config.port,
            sock=socks,
            limits=config.http_limits,
            on_refused=process.node.timings.http_refused.count,
            **kwargs,
        )
    finally:
        process.close()
    if process.registrar is not None and process.registrar.fatal is not None:
        log.error("refused to keep running: %s", process.registrar.fatal)
        return 2
    return 0
