"""Ground truth read from the nodes themselves, each replica's directory, and the comparison.

A placement is ``(key digest, holder, tier, backend)``; the holder is the instance for its own
tiers and ``(pool)`` for the shared pool (one copy fleet-wide). The truth is what each node's
L1 really holds (``GET /engine/inventory``, read from the L1 itself) and the files really on
disk: each private L2 directory and the pool, named by their key's digest. So a node whose
bookkeeping drifted from its tiers shows as a difference too, and the node's own L2 listing
is checked against its disk (``l2_index_drift``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvatlas.keys import ObjectKey
from kvatlas.node.l2 import key_digest

PlacementRow = tuple[str, str, str, str]  # (key digest, holder, tier, backend)
SHARED_HOLDER = "(pool)"


def files_on_disk(root: Path) -> set[str]:
    """Key digests of the chunk files under an fs L2 directory (``<d[:2]>/<d>.kvc``)."""
    return {p.stem for p in root.glob("*/*.kvc")}


def disk_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (temp files of a write in progress included) that
    all existed at one instant: a walk sees files at different times (one evicted after it
    was counted, its replacement written before the walk reached it), so only files still
    there, unchanged, once the walk is done are summed — never more than the directory
    really held at the end of the walk."""
    seen: list[tuple[Path, int]] = []
    for p in root.glob("**/*"):
        with contextlib.suppress(OSError):  # removed while we looked (an eviction)
            if p.is_file():
                seen.append((p, p.stat().st_size))
    total = 0
    for p, size in seen:
        with contextlib.suppress(OSError):
            total += size if p.stat().st_size == size else 0
    return total


def _digest(wire_key: dict[str, Any]) -> str:
    return key_digest(ObjectKey.from_wire(wire_key))


@dataclass(frozen=True)
class NodeTruth:
    """One node's placements and how its L2 listing compares with its disk."""

    rows: frozenset[PlacementRow]
    l2_index_drift: int  # keys in the node's L2 listing xor files on its disk


def node_truth(name: str, url: str, l2_dir: Path, l2_backend: str, *, shared: bool) -> NodeTruth:
    reply = httpx.get(f"{url}/engine/inventory", headers={"Accept": "application/json"}, timeout=10)
    reply.raise_for_status()
    listed = reply.json()["placements"]
    rows = {(_digest(p["key"]), name, p["tier"], p["backend"]) for p in listed if p["tier"] == "l1"}
    on_disk = files_on_disk(l2_dir)
    holder = SHARED_HOLDER if shared else name
    rows |= {(d, holder, "l2", l2_backend) for d in on_disk}
    indexed = {_digest(p["key"]) for p in listed if p["tier"] == "l2"}
    drift = 0 if shared else len(indexed ^ on_disk)
    return NodeTruth(frozenset(rows), drift)


def directory_rows(url: str) -> set[PlacementRow]:
    """Every placement of a replica's directory, paged through ``GET /directory/keys``."""
    rows: set[PlacementRow] = set()
    cursor = None
    with httpx.Client(base_url=url, timeout=10) as client:
        while True:
            params: dict[str, Any] = {"limit": 500}
            if cursor:
                params["cursor"] = cursor
            reply = client.get("/directory/keys", params=params)
            reply.raise_for_status()
            page = reply.json()
            for item in page["keys"]:
                d = _digest(item["key"])
                for p in item["placements"]:
                    holder = SHARED_HOLDER if p["shared"] else p["instance_id"]
                    rows.add((d, holder, p["tier"], p["backend"]))
            cursor = page["next_cursor"]
            if cursor is None:
                return rows


@dataclass(frozen=True)
class Difference:
    """A replica's directory against the truth."""

    ghosts: frozenset[PlacementRow]  # the directory says held; no node holds it
    missing: frozenset[PlacementRow]  # a node holds it; the directory does not say so
    error: str = ""  # the replica could not be read

    @property
    def agrees(self) -> bool:
        return not (self.ghosts or self.missing or self.error)

    def __str__(self) -> str:
        if self.error:
            return f"unreadable ({self.error})"
        shown = self.to_json(3)
        return (
            f"{len(self.ghosts)} ghosts {shown['ghost_examples']}, "
            f"{len(self.missing)} missing {shown['missing_examples']}"
        )

    def to_json(self, examples: int = 5) -> dict[str, Any]:
        def shown(rows: Iterable[PlacementRow]) -> list[str]:
            return [f"{h}/{t}/{b}:{d[:12]}" for d, h, t, b in sorted(rows)[:examples]]

        return {
            "ghosts": len(self.ghosts),
            "missing": len(self.missing),
            "error": self.error,
            "ghost_examples": shown(self.ghosts),
            "missing_examples": shown(self.missing),
        }


def compare(truth: set[PlacementRow], replica_url: str) -> Difference:
    try:
        rows = directory_rows(replica_url)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Difference(frozenset(), frozenset(), f"{type(exc).__name__}: {exc}")
    return Difference(frozenset(rows - truth), frozenset(truth - rows))
