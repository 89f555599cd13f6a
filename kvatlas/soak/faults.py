"""The seeded fault schedule: which fault, when, on what, for how long. Same seed and length,
same schedule (it depends on nothing else); every kind is in every schedule."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from kvatlas.soak.fleet import POOL, PRIVATE_NODES, REPLICAS, FleetSettings

NODE_KILL = "node_kill"  # kill -9, restarted with the same instance id and L2 directory
REPLICA_KILL = "replica_kill"  # kill -9, restarted with the same replica id and snapshot
REDIS_RESTART = "redis_restart"  # kill -9 of redis-server, restarted on the same port (AOF)
NODE_PAUSE = "node_pause"  # SIGSTOP past the instance timeout, then SIGCONT
L2_FILL = "l2_fill"  # a burst of stores of twice the L2 cap on one node
KINDS = (NODE_KILL, REPLICA_KILL, REDIS_RESTART, NODE_PAUSE, L2_FILL)
SLOT_SECONDS = 20.0  # a long run gets about one fault per slot


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the workload started
    kind: str
    target: str
    hold: float  # seconds down or paused (l2_fill: 0)
    chunks: int = 0  # l2_fill: chunks stored in the burst

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def schedule(seed: int, seconds: float, settings: FleetSettings) -> list[Fault]:
    """At least one fault of each kind, spread over ``seconds``: one per slot, at a seeded
    offset in the first half of its slot (the second half leaves time to repair)."""
    rng = random.Random(seed)
    n = max(len(KINDS), int(seconds // SLOT_SECONDS))
    kinds = list(KINDS)
    rng.shuffle(kinds)
    kinds += [rng.choice(KINDS) for _ in range(n - len(KINDS))]
    slot = seconds / n
    nodes = (*PRIVATE_NODES, POOL)
    faults = []
    for i, kind in enumerate(kinds):
        at = round(i * slot + rng.uniform(0.05, 0.5) * slot, 3)
        if kind == NODE_KILL:
            fault = Fault(at, kind, rng.choice(nodes), round(rng.uniform(0.2, 2.0), 3))
        elif kind == REPLICA_KILL:
            fault = Fault(at, kind, rng.choice(REPLICAS), round(rng.uniform(0.2, 2.0), 3))
        elif kind == REDIS_RESTART:
            fault = Fault(at, kind, "redis", round(rng.uniform(0.2, 2.0), 3))
        elif kind == NODE_PAUSE:
            hold = settings.instance_timeout * rng.uniform(1.5, 2.5)
            fault = Fault(at, kind, rng.choice(nodes), round(hold, 3))
        else:
            fault = Fault(at, kind, rng.choice(PRIVATE_NODES), 0.0, 2 * settings.l2_chunks)
        faults.append(fault)
    return faults
