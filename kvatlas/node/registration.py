"""How a node reaches its coordinator: the compatibility check at first contact (key scheme,
chunk size, event transport and stream; ``docs/node.md``), registration (signed with the peer
secret when there is one) and, for a coordinator not up at start-up, :class:`Registrar`, which
retries in the background until it can register (any start order)."""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Callable

from kvatlas.api import HealthReply
from kvatlas.backoff import Backoff
from kvatlas.client import CoordinatorClient, CoordinatorError, HttpTransport
from kvatlas.errors import Conflict
from kvatlas.node.config import NodeConfig

log = logging.getLogger(__name__)


class TransportMismatch(Conflict):
    """The node would report events where its coordinator does not read them."""


RETRY_LATER = frozenset({408, 429})  # "too slow to arrive", "too many requests": not a no


def is_refusal(exc: CoordinatorError) -> bool:
    """The coordinator answered and said no (or answered not as one): stop, do not retry."""
    status = exc.reply_status
    return status is not None and status < 500 and status not in RETRY_LATER


class Registrar:
    """Reaches a coordinator that was not up at start-up: first contact (``/healthz`` and
    :func:`check_coordinator_compatible`), registration under ``instance_id``, heartbeats,
    then ``on_registered``. Attempts back off (:class:`~kvatlas.backoff.Backoff`) from
    ``initial`` up to ``retry_max`` seconds, jittered; each new step is logged once (not every
    attempt), and attempts are counted in ``attempts``. A mismatch found at first contact stops the retries
    and goes to ``on_fatal``."""

    def __init__(
        self,
        client: CoordinatorClient,
        config: NodeConfig,
        instance_id: str,
        *,
        on_registered: Callable[[], object],
        on_fatal: Callable[[Conflict], object],
        on_health: Callable[[HealthReply], object] = lambda _health: None,
        initial: float = 0.1,
        retry_max: float = 30.0,
        jitter: Callable[[], float] = random.random,
        counters: Counter[str] | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.instance_id = instance_id
        self._on_registered = on_registered
        self._on_fatal = on_fatal
        self._on_health = on_health
        self.initial = initial
        self.retry_max = retry_max
        self._jitter = jitter
        self.attempts = 0
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.started = False
        self.registered = threading.Event()
        self.fatal: Conflict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvatlas-registrar", daemon=True)

    def start(self) -> Registrar:
        self.started = True
        self._thread.start()
        return self

    def attempt(self) -> None:
        """One try: raises :class:`CoordinatorError` (retry) or ``Conflict`` (a mismatch)."""
        self.attempts += 1
        health = self.client.health()
        check_coordinator_compatible(self.config, health)
        self._on_health(health)
        register(self.client, self.config, self.instance_id)

    def _run(self) -> None:
        backoff = Backoff(self.initial, self.retry_max, self._jitter)
        while not self._stop.is_set():
            try:
                self.attempt()
            except CoordinatorError as exc:
                if is_refusal(exc):
                    self.fatal = Conflict(
                        f"{self.config.coordinator_url} refused this node or is not a kvatlas "
                        f"or LMCache coordinator: {exc}"
                    )
                    log.error("stopping: %s", self.fatal)
                    self._on_fatal(self.fatal)
                    return
                self.counters["coordinator_contact_failures"] += 1
                if backoff.report():
                    log.warning(
                        "coordinator %s not reachable (attempt %d: %s); serving local tiers, "
                        "retrying every %.3g s at most",
                        self.config.coordinator_url, self.attempts, exc, backoff.step,
                    )  # fmt: skip
                self._stop.wait(backoff.next_wait())
                continue
            except Conflict as exc:
                self.fatal = exc
                log.error("stopping: %s", exc)
                self._on_fatal(exc)
                return
            log.info(
                "registered with %s as %s after %d attempts",
                self.config.coordinator_url, self.instance_id, self.attempts,
            )  # fmt: skip
            self.registered.set()
            self._on_registered()
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def follow_coordinator_format(transport: HttpTransport, health: HealthReply) -> None:
    """Events as JSON to a coordinator that does not state its key scheme (LMCache's reads
    JSON events only); msgpack, the default, to kvatlas's."""
    if not health.states_hash_scheme:
        transport.fmt = "json"


def register(client: CoordinatorClient, config: NodeConfig, instance_id: str | None) -> str:
    """Register (``instance_id`` ``None``: the coordinator assigns one); the caller starts the
    heartbeats. With a peer secret the advertised URL goes with its signature for this id
    (``peer_credentials``): peers call no URL without one. An assigned id is learned first,
    then registered again, signed."""
    advertised = config.advertised_url or f"http://{config.host}:{config.port}"
    secret = config.peer_secret()

    def once(asked: str | None) -> str:
        signature = None
        if secret is not None and asked is not None:
            signature = secret.sign_url(asked, advertised)
        return client.register(
            asked, ip=config.host, http_port=config.port, p2p_advertised_url=advertised,
            metadata={
                "model_name": config.model_name, "kv_rank": config.kv_rank,
                "mode": "fleet" if config.fleet_enabled else "lookup only",
                # (api.fleet.PEER_METADATA: what a peer reads of them)
                "kv_shape": list(config.layout.shape), "kv_dtype": config.layout.dtype,
            },
            chunk_size=config.chunk_size, p2p_url_signature=signature,
            engine_id=config.engine_id,
        )  # fmt: skip

    assigned = once(instance_id)
    if secret is not None and instance_id is None:
        once(assigned)
    return assigned


def check_coordinator_compatible(config: NodeConfig, health: HealthReply) -> None:
    """Compare this node's configuration with the coordinator's ``/healthz`` (``docs/node.md``).

    Refuses (raises) on a key scheme, chunk size or, for a reporting node, event transport
    mismatch; warns when the node answers blend lookups but the coordinator has them off.
    LMCache's coordinator states none of these (``{"status": "healthy"}``): then the chunk
    size is checked at registration (LMCache 0.5.7 refuses a conflicting one) and the rest
    is the operator's to match (docs/coordinator.md, "Running kvatlas under LMCache MP servers").
    """
    if health.hash_scheme is None:
        log.warning(
            "the coordinator at %s does not state its key scheme (LMCache's coordinator?): "
            "make sure it runs with --chunk-size %d and that this node's %s keys are its keys",
            config.coordinator_url, config.chunk_size, config.scheme.name,
        )  # fmt: skip
        return
    chunk_size = -1 if health.chunk_size is None else health.chunk_size
    config.scheme.check_compatible(health.hash_scheme, chunk_size)
    if not config.fleet_enabled:
        return
    theirs = health.event_transport
    if theirs is not None and theirs != config.event_transport:
        raise TransportMismatch(
            f"event transport mismatch: this node uses --event-transport "
            f"{config.event_transport}, the coordinator at {config.coordinator_url} uses "
            f"--event-transport {theirs}; it would never see this node's chunks"
        )
    stream = health.event_stream
    if config.event_transport == "redis" and stream is not None and stream != config.event_stream:
        raise TransportMismatch(
            f"event stream mismatch: this node writes --event-stream {config.event_stream}, "
            f"the coordinator at {config.coordinator_url} reads --event-stream {stream}; "
            "it would never see this node's chunks"
        )
    if config.enable_blend_lookup and health.enable_blend_lookup is False:
        log.warning(
            "blend lookup mismatch: this node has --enable-blend-lookup on, the coordinator at "
            "%s has it off; every fleet leg of a blend lookup will answer empty",
            config.coordinator_url,
        )
