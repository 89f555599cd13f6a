"""Running the coordinator: ``kvatlas coordinator`` and an in-process background server.

The background server (uvicorn in a thread on a chosen or free port) is what the embedded
demo and the tests use: real HTTP on loopback, real sockets, the same app. See
docs/coordinator.md.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Final, TypeVar

from kvatlas.asgi_thread import StopServing, ThreadedServer, bind_listener, free_port, serve
from kvatlas.auth import TokenAuth
from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.cache_control.delivery_contract import MpServers
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.runtime import (
    COLLECTIONS,
    MEMORY_TRIM,
    GrowthFreeze,
    freeze_long_lived,
    set_switch_interval,
)
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.errors import KvatlasError
from kvatlas.logs import configure_logging, uvicorn_log_options
from kvatlas.web import is_loopback

__all__ = [
    "BackgroundServer",
    "announce_security",
    "claim_or_exit",
    "claim_replica",
    "claim_state",
    "free_port",
    "run_coordinator",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


def announce_security(config: CoordinatorConfig) -> None:
    if config.auth_token_file is not None:
        log.info("auth enabled (tokens from %s)", config.auth_token_file)
    elif is_loopback(config.host):
        log.info("auth disabled: bound to loopback %s only", config.host)
    else:
        log.warning(
            "auth disabled and bound to %s: anyone who can reach this port can post events "
            "and query every namespace; use --auth-token-file",
            config.host,
        )


def lock_snapshot_path(path: Path) -> IO[str]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` for as long as the returned file stays
    open (the process's lifetime), so two coordinators never share one snapshot file.
    Raises :class:`OSError` naming the lock file when another process holds it."""
    lock_path = path.with_name(path.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock_path, "a")  # noqa: SIM115 - held open until the process exits
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        raise OSError(
            exc.errno, f"snapshot {path} is in use by another coordinator (lock {lock_path} held)"
        ) from exc
    return handle


def claim_replica(config: CoordinatorConfig) -> tuple[socket.socket, IO[str] | None]:
    """Before any start-up work: bind the port, lock the snapshot path and (Redis transport)
    check that no live replica consumes this replica's group, so a second coordinator with the
    same flags or replica id stops before it restores, joins the group or writes a snapshot.
    Returns the listening socket and the held lock; raises :class:`OSError` (port, lock),
    :class:`~kvatlas.errors.Conflict` (group held) or :class:`~kvatlas.errors.Unavailable`
    (Redis cannot tell), having released what it took."""
    sock = bind_listener(config.host, config.port)
    try:
        return sock, claim_state(config)
    except BaseException:
        sock.close()
        raise


def claim_state(config: CoordinatorConfig) -> IO[str] | None:
    """:func:`claim_replica` without the port: lock the snapshot path and (Redis transport)
    refuse a consumer group a live replica holds. For a replica that serves no HTTP of its
    own (``kvatlas router --scores-from replica``). Returns the held lock (or ``None``)."""
    lock = None
    try:
        if config.snapshot_path is not None:
            lock = lock_snapshot_path(config.snapshot_path)
        if config.event_transport == "redis":
            from kvatlas.coordinator.consumer_group import refuse_held_group

            refuse_held_group(config)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return lock


_HELD: Final = frozenset({errno.EADDRINUSE, errno.EAGAIN, errno.EWOULDBLOCK})
"""The errors of a port or lock another process holds."""


def stopper_of(service: CoordinatorService) -> StopServing:
    """What stops serving when Redis, first reached after start-up, refuses the credentials of
    ``service``'s stream consumer: exit 1, as at start (the coordinator's, a router's replica)."""
    stopper = StopServing()
    if (consumer := service.stream_consumer) is not None:
        consumer.on_fatal = stopper.stop
        if consumer.fatal is not None:  # (found before on_fatal was set)
            stopper.stop(consumer.fatal)
    return stopper


def claim_or_exit(claim: Callable[[], T], holder: str) -> T:
    """``claim()`` (:func:`claim_replica`, :func:`claim_state`), or, once the reason is logged,
    ``SystemExit(1)``: the port, the snapshot lock or the consumer group is another process's
    (``holder``: who that is likely to be, for the message), or Redis cannot tell."""
    try:
        return claim()
    except OSError as exc:
        if exc.errno in _HELD:
            log.error("%s; is another %s running? not starting", exc.strerror or exc, holder)
        else:  # a path that cannot be (under a file, in /proc, not writable): say which
            log.error("%s; not starting", exc)
    except KvatlasError as exc:
        log.error("%s; not starting", exc)
    raise SystemExit(1)


class BackgroundServer:
    """The coordinator (service + HTTP) in this process, served in a daemon thread. It claims
    its port, snapshot lock and consumer group like ``kvatlas coordinator`` does
    (:func:`claim_replica`), and releases them on :meth:`stop`."""

    def __init__(
        self,
        config: CoordinatorConfig,
        clock: Callable[[], float] = time.monotonic,
        mp_servers: MpServers | None = None,
    ) -> None:
        """``clock`` times instance heartbeats (tests inject a fake one); ``mp_servers``:
        the client cache-control commands are delivered with (:class:`CoordinatorService`)."""
        self.config = config
        self.service = CoordinatorService(config, clock, mp_servers)
        self.app = create_app(self.service)
        self._http = ThreadedServer(
            self.app,
            port=config.port,
            host=config.host,
            name="coordinator",
            limits=config.http_limits,
            on_refused=self.service.metrics.http_refused.count,
        )
        self._lock: IO[str] | None = None

    @property
    def url(self) -> str:
        return self._http.url

    def start(self, timeout: float = 20.0) -> BackgroundServer:
        sock, self._lock = claim_replica(self.config)
        try:
            self.service.start()
        except BaseException:  # nothing to snapshot: it never started
            sock.close()
            self._release()
            raise
        try:
            self._http.start(timeout, sock)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._http.stop()
        self.service.stop()
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_coordinator(config: CoordinatorConfig, mp_servers: MpServers | None = None) -> int:
    """``kvatlas coordinator`` (``mp_servers``: the MP-server client cache-control commands
    are delivered with; ``kvatlas.cli`` hands in ``kvatlas.client.MPServerClient``). Exits 1
    (``SystemExit``) when another process holds its port, snapshot or consumer group;
    returns 1 when a Redis first reached after start-up refuses the credentials."""
    configure_logging(config.log_level, config.log_format)
    set_switch_interval()  # runtime.py: one thread's Python work must not stall the others
    COLLECTIONS.install()
    announce_security(config)
    if config.auth_token_file is not None:
        try:  # the rule of kvatlas/auth.py: a private file, tokens of 32+ characters
            TokenAuth.from_file(config.auth_token_file)
        except ValueError as exc:
            log.error("refusing to start: %s", exc)
            print(f"kvatlas coordinator: refusing to start: {exc}", file=sys.stderr)
            return 2
    if config.event_transport == "redis":
        log.info("replica %s, consumer group %s", config.resolved_replica_id, config.group_name)
    # Claim the port, the snapshot file and the consumer group before restoring, joining the
    # group or serving: a second coordinator with the same flags or replica id must not take
    # batches from the live one nor overwrite its snapshot on the way out (docs/coordinator.md).
    sock, lock = claim_or_exit(lambda: claim_replica(config), "coordinator")
    service = CoordinatorService(config, mp_servers=mp_servers)
    service.start()
    stopper = stopper_of(service)
    log.info(
        "kvatlas coordinator on http://%s:%d (scheme %s/%d, blend %s, transport %s, replica %s)",
        config.host, config.port, config.hash_scheme, config.chunk_size,
        "on" if config.enable_blend_lookup else "off", config.event_transport,
        config.resolved_replica_id,
    )  # fmt: skip
    app = create_app(service)
    # Everything allocated so far (framework, routes, compiled kernels, the restored directory)
    # lives for the whole process: out of the collector's sight (runtime.py says why it is safe).
    freeze_long_lived()
    COLLECTIONS.reset()  # from here on: the pauses requests can see
    growth = GrowthFreeze(service.directory.key_count)
    service.snapshots.after = lambda info: growth.after_snapshot(info.keys)
    if config.memory_trim_interval_s > 0:  # runtime.py: freed heap pages back to the kernel
        MEMORY_TRIM.interval_s = config.memory_trim_interval_s
        MEMORY_TRIM.start()
    try:
        options = uvicorn_log_options(config.log_level, config.access_log)
        serve(
            app,
            host=config.host,
            port=config.port,
            sock=sock,
            limits=config.http_limits,
            on_refused=service.metrics.http_refused.count,
            stopper=stopper,
            **options,
        )
    finally:
        MEMORY_TRIM.stop()
        service.stop()
        sock.close()
        if lock is not None:
            lock.close()
    return stopper.exit_code()
