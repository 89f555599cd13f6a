"""Usage in LMCache's shape: per instance its own (tier, backend) modules and per shared pool,
the capacity declared by config batches beside the bytes its placements hold (the directory
keeps both per module), and its JSON. Served by ``routes/usage.py``; see docs/coordinator.md
("API")."""

from __future__ import annotations

from kvatlas.api import FleetUsageReply, InstanceUsageReply, ModuleUsageRow
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.views import FleetUsage, InstanceUsage
from kvatlas.directory import DirectoryUsage, KeyDirectory, ModuleUsage


def fleet_usage(directory: KeyDirectory, instances: InstanceRegistry) -> FleetUsage:
    """Every registered, declaring or placement-holding instance, and every shared pool."""
    found = directory.usage()
    registered = {r.instance_id for r in instances.records()}
    owners = {m.instance_id for m in found.modules if m.instance_id is not None}
    ids = sorted(registered | found.declared | owners)
    return FleetUsage(
        tuple(_instance_usage(i, found, i in registered) for i in ids),
        tuple(m for m in found.modules if m.instance_id is None),
    )


def instance_usage(
    directory: KeyDirectory, instances: InstanceRegistry, instance_id: str
) -> InstanceUsage:
    return _instance_usage(instance_id, directory.usage(), instances.known(instance_id))


def _instance_usage(instance_id: str, usage: DirectoryUsage, registered: bool) -> InstanceUsage:
    modules = tuple(m for m in usage.modules if m.instance_id == instance_id)
    return InstanceUsage(instance_id, registered, instance_id in usage.declared, modules)


def module_usage_to_wire(m: ModuleUsage) -> ModuleUsageRow:
    """One module of ``/instances/usage``; ``usage_ratio`` is ``None`` without a capacity."""
    ratio = m.used_bytes / m.capacity_bytes if m.capacity_bytes > 0 else None
    return ModuleUsageRow(
        tier=m.tier,
        backend=m.backend,
        shared=m.instance_id is None,
        used_bytes=m.used_bytes,
        capacity_bytes=m.capacity_bytes,
        usage_ratio=ratio,
    )


def instance_usage_to_wire(u: InstanceUsage) -> InstanceUsageReply:
    """``GET /instances/{id}/usage`` (and one row of ``GET /instances/usage``)."""
    return InstanceUsageReply(
        instance_id=u.instance_id,
        registered=u.registered,
        declared_capacity=u.declared_capacity,
        modules=[module_usage_to_wire(m) for m in u.modules],
    )


def usage_to_wire(u: FleetUsage) -> FleetUsageReply:
    """``GET /instances/usage``: every instance's modules, then the shared pools."""
    return FleetUsageReply(
        instances=[instance_usage_to_wire(i) for i in u.instances],
        shared_modules=[module_usage_to_wire(m) for m in u.shared_modules],
    )
