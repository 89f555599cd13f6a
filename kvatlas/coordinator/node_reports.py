"""What nodes report about the value of the cache (``PUT /instances/{id}/report``), summed
over the fleet: query tokens, prefix and fragment hit tokens, and the **regret** — tokens
recomputed although the directory listed them on another instance. Tokens recomputed are
derived (query − prefix hits − fragment hits), so every reported counter only ever grows.

A report carries a node's *cumulative* counters since it started (``boot``) plus its tier
gauges, so a lost or repeated report changes nothing: the fleet totals grow by the difference
to the instance's previous report of the same boot (a new boot, or a counter that went down,
counts from zero). The first report of an instance restored from the snapshot (registered
before this coordinator started, its node running on) is a baseline: it adds nothing. The totals only ever grow; they are exported as Prometheus counters and
feed the status page. See docs/operator.md ("Regret").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvatlas.checks import is_plain_int
from kvatlas.errors import Unprocessable

MAX_BOOT_CHARS = 64


@dataclass(frozen=True, slots=True)
class ValueCounters:
    """Token counters, cumulative: a node's since its boot, or the fleet's since this
    coordinator started."""

    query_tokens: int = 0
    """Tokens of prefix retrievals (the prefix hit rate's divisor)."""
    prefix_hit_tokens: int = 0
    fragment_hit_tokens: int = 0
    regret_tokens: int = 0
    blend_query_tokens: int = 0
    """Tokens after the prefix of blend lookups (the fragment hit rate's divisor)."""

    @property
    def recomputed_tokens(self) -> int:
        return max(0, self.query_tokens - self.prefix_hit_tokens - self.fragment_hit_tokens)

    def minus(self, earlier: ValueCounters) -> ValueCounters:
        """Growth since ``earlier``; a counter that went down restarted, so it counts whole."""
        return ValueCounters(
            *(
                now - then if now >= then else now
                for now, then in zip(_values(self), _values(earlier), strict=True)
            )
        )

    def plus(self, other: ValueCounters) -> ValueCounters:
        return ValueCounters(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))


@dataclass(frozen=True, slots=True)
class TierGauges:
    """A node's tiers at report time (capacity 0: unknown or no such tier)."""

    l1_bytes: int = 0
    l1_capacity_bytes: int = 0
    l1_chunks: int = 0
    l2_bytes: int = 0
    l2_capacity_bytes: int = 0
    l2_chunks: int = 0


@dataclass(frozen=True, slots=True)
class NodeReport:
    boot: str
    counters: ValueCounters
    tiers: TierGauges

    def to_wire(self) -> dict[str, Any]:
        return {"boot": self.boot, **_as_dict(self.counters), **_as_dict(self.tiers)}

    @classmethod
    def from_wire(cls, obj: Any) -> NodeReport:
        """Refuses (422) unknown fields, negative or non-integer counts, a missing boot."""
        if not isinstance(obj, Mapping):
            raise Unprocessable("report: expected a JSON object")
        known = {"boot", *_names(ValueCounters), *_names(TierGauges)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise Unprocessable(f"report: unknown field {unknown[0]!r}")
        boot = obj.get("boot")
        if not isinstance(boot, str) or not 0 < len(boot) <= MAX_BOOT_CHARS:
            raise Unprocessable(f"report.boot: a string of 1..{MAX_BOOT_CHARS} characters")
        return cls(
            boot,
            ValueCounters(**_counts(obj, ValueCounters)),
            TierGauges(**_counts(obj, TierGauges)),
        )


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _values(obj: ValueCounters) -> list[int]:
    return [getattr(obj, name) for name in _names(ValueCounters)]


def _as_dict(obj: ValueCounters | TierGauges) -> dict[str, int]:
    return {name: getattr(obj, name) for name in _names(type(obj))}


def _counts(obj: Mapping[str, Any], cls: type) -> dict[str, int]:
    out = {}
    for name in _names(cls):
        value = obj.get(name, 0)
        if not is_plain_int(value) or not 0 <= value < 2**63:
            raise Unprocessable(f"report.{name}: a non-negative integer")
        out[name] = value
    return out


MAX_DEPARTED = 4096
"""Departed instances whose last report is remembered (a fenced node that registers again
with the same boot counts its growth, not its counters again)."""


class NodeReports:
    """The last report of each instance and the fleet's totals (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, NodeReport] = {}
        self._departed: OrderedDict[str, NodeReport] = OrderedDict()
        self._totals = ValueCounters()

    def accept(self, instance_id: str, report: NodeReport, *, carried_over: bool = False) -> None:
        """Add the report's growth over the instance's previous one of the same boot; a new
        boot counts whole. ``carried_over``: the instance was registered before this
        coordinator started (restored from its snapshot) and has not registered since, so
        its node kept running: its first report here is a baseline that adds nothing (its
        counters hold tokens the previous coordinator counted)."""
        with self._lock:
            before = self._last.get(instance_id) or self._departed.pop(instance_id, None)
            if before is None and carried_over:
                growth = ValueCounters()
            elif before is not None and before.boot == report.boot:
                growth = report.counters.minus(before.counters)
            else:
                growth = report.counters
            self._totals = self._totals.plus(growth)
            self._last[instance_id] = report

    def retain(self, instance_ids: set[str]) -> None:
        """Keep only these instances' last reports (the others departed: their tiers leave
        the status page; their counters are remembered, the latest :data:`MAX_DEPARTED`);
        the totals keep what every instance reported."""
        with self._lock:
            for gone in set(self._last) - instance_ids:
                self._departed[gone] = self._last.pop(gone)
                self._departed.move_to_end(gone)
            while len(self._departed) > MAX_DEPARTED:
                self._departed.popitem(last=False)

    def totals(self) -> ValueCounters:
        with self._lock:
            return self._totals

    def tiers(self) -> dict[str, TierGauges]:
        with self._lock:
            return {inst: r.tiers for inst, r in self._last.items()}
