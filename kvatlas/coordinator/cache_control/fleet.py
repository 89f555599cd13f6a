"""Cache control wired into the coordinator (:func:`cache_control_of`), and what delivery
reads of it (:class:`~.delivery_contract.Fleet`): where a registered instance's MP server listens, which
instances share an L2 pool, and the copies the directory shows of keys."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from kvatlas.coordinator.cache_control.delivery import Delivery
from kvatlas.coordinator.cache_control.delivery_contract import Copy, MpServers, no_servers
from kvatlas.coordinator.cache_control.eviction import DEFAULT_POLICY, EvictionPolicy
from kvatlas.coordinator.cache_control.eviction_loop import FleetEviction
from kvatlas.coordinator.cache_control.metrics import CacheControlCollector
from kvatlas.coordinator.cache_control.service import CacheControl
from kvatlas.coordinator.cache_control.shared_commands import SharedCommandLog
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.coordinator.cache_control.shared_tables import SharedPinTable, SharedQuotaTable
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.directory import KeyDirectory
from kvatlas.keys import ObjectKey


class CoordinatorFleet:
    def __init__(
        self,
        instances: InstanceRegistry,
        directory: KeyDirectory,
        seen: Callable[[], Mapping[str, str | None]] = dict,
    ) -> None:
        """``seen``: the instances some replica recorded as registered lately (the service's
        ``elsewhere``, from ``<stream>:instances``; empty without replicas)."""
        self.instances = instances
        self.directory = directory
        self.seen = seen

    def registered_elsewhere(self, instance_id: str) -> bool:
        """Registered with another replica, not with this one (its MP server is that
        replica's to call)."""
        return instance_id in self.seen() and not self.instances.known(instance_id)

    def gone(self, instance_id: str) -> bool:
        """Not to be asked (no MP server registered here, not registered with another
        replica), and every live instance has had its timeout to register since this one
        started (:meth:`InstanceRegistry.heard_all`): after a restart an unregistered
        instance may be alive and not heard yet."""
        return (
            self.url_of(instance_id) is None
            and not self.registered_elsewhere(instance_id)
            and self.instances.heard_all()
        )

    def url_of(self, instance_id: str) -> str | None:
        """The MP-server URL a registered instance gave (``http://ip:http_port``, as LMCache's
        coordinator calls it); ``None``: not registered, or no port."""
        record = next((r for r in self.instances.records() if r.instance_id == instance_id), None)
        if record is None or not record.registration.http_port:
            return None
        ip = record.registration.ip or "127.0.0.1"
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{record.registration.http_port}"

    def pools_of(self, instance_id: str) -> set[str]:
        """The shared L2 pools (by backend) the instance declared capacity in (an L2 it
        declared private, ``shared: false``, is its own module even beside a pool of that
        backend: no membership)."""
        modules = self.directory.usage().modules
        shared = {m.backend for m in modules if m.instance_id is None}
        private = {m.backend for m in modules if m.instance_id == instance_id and m.tier == "l2"}
        declared = self.directory.capacities().get(instance_id)
        own = set() if declared is None else {b for t, b in declared.capacities if t == "l2"}
        return (shared & own) - private

    def pool_members(self, backend: str) -> list[str]:
        """Registered instances that declared capacity in the shared L2 pool ``backend``."""
        return sorted(
            r.instance_id
            for r in self.instances.records()
            if backend in self.pools_of(r.instance_id)
        )

    def copies(self, keys: Sequence[ObjectKey]) -> list[list[Copy]]:
        return [
            [Copy(p.instance_id, p.tier, p.backend, p.shared) for p in found.placements]
            for found in self.directory.lookup(keys)
        ]

    def copy_bytes(self, keys: list[ObjectKey]) -> int:
        """Bytes of every copy of ``keys`` (pinned bytes)."""
        return sum(p.size_bytes for found in self.directory.lookup(keys) for p in found.placements)


def cache_control_of(
    chunk_size: int,
    hash_chunks: Callable[[list[int]], list[bytes]],
    instances: InstanceRegistry,
    directory: KeyDirectory,
    registry: CollectorRegistry,
    mp_servers: MpServers | None,
    eviction_policy: EvictionPolicy = DEFAULT_POLICY,
    store: SharedStore | None = None,
    lease_s: float = 30.0,
    seen: Callable[[], Mapping[str, str | None]] = dict,
) -> tuple[CacheControl, Delivery]:
    """A coordinator's cache control (keys by its own hashing, usage from its directory's L2
    bytes) and its delivery (``mp_servers``: the client commands are delivered with; ``None``:
    none, they stay pending), which runs the fleet eviction pass with ``eviction_policy``; its
    figures on ``registry``. With ``store`` (the Redis transport) pins, quotas and commands
    are the fleet's, in Redis, and each command is leased to one replica for ``lease_s``;
    ``seen``: the instances the replicas recorded as registered (:class:`CoordinatorFleet`)."""
    shared: dict[str, Any] = {}
    if store is not None:
        shared = {
            "pins": SharedPinTable(store),
            "quotas": SharedQuotaTable(store),
            "commands": SharedCommandLog(store, lease_s=lease_s),
            "store": store,
        }

    def is_instance(instance_id: str) -> bool:  # registered with this replica or another
        return instances.known(instance_id) or instance_id in seen()

    control = CacheControl(
        chunk_size, is_instance=is_instance, usage_by_salt=directory.bytes_by_salt,
        hash_chunks=hash_chunks, may_hold=instances.may_hold, **shared,
    )  # fmt: skip
    fleet = CoordinatorFleet(instances, directory, seen)
    delivery = Delivery(lambda: control.commands, fleet, mp_servers or no_servers)
    eviction = FleetEviction(lambda: control, directory, eviction_policy)
    delivery.eviction = eviction.maybe_run
    delivery.pinned = lambda keys: control.pins.pinned(keys)
    registry.register(CacheControlCollector(lambda: control, fleet.copy_bytes, eviction))
    return control, delivery
