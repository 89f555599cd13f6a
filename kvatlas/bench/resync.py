"""resync: bytes one digest exchange sends to repair a drifted directory, vs a full listing.

A node holds ``--placements`` L1 placements; the coordinator's view of it has drifted by
``--drift`` (half of the drifted placements lost stores, half ghosts). One exchange (root
digests, refined digests of the large differing buckets, ``resync`` batches) is run against a
real :class:`~kvatlas.directory.KeyDirectory`; every body is encoded as it travels (digests as
JSON, batches as msgpack) and counted. The full listing is the same batches for every prefix.
Token ids (``chunk_size`` × 4 bytes per chunk, when a resync carries them) are added per entry.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvatlas.bench.common import bar_chart
from kvatlas.directory import KeyDirectory
from kvatlas.events import RESYNC, STORE, CacheEntry, EventBatch, encode_msgpack
from kvatlas.events.inventory import BUCKETS, differing, digest_from_hex
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.inventory import NodeInventory, ResyncDriver, SendResync

TIER, BACKEND, INSTANCE = "l1", "dram", "node-0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placements", type=int, default=1_000_000, help="node's placements")
    parser.add_argument("--drift", type=float, default=0.001, help="fraction of them drifted")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (deterministic)")
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the bytes of both cases into this PNG (needs matplotlib: "
        "pip install 'kvatlas[plot]')",
    )


class _Wire:
    """The coordinator end of the exchange, counting every byte both ways."""

    def __init__(self, directory: KeyDirectory) -> None:
        self.directory = directory
        self.seq = 1_000_000
        self.digest_bytes = 0
        self.batch_bytes = 0
        self.batches = 0
        self.entries = 0

    def exchange(self, tiers: dict[str, dict[str, str]]) -> dict[str, list[str]]:
        self.digest_bytes += len(json.dumps({"tiers": tiers}))
        out: dict[str, list[str]] = {}
        for tier, by_prefix in tiers.items():
            out[tier] = []
            for prefix_hex, digest_hex in by_prefix.items():
                prefix = bytes.fromhex(prefix_hex)
                mine = self.directory.digest(INSTANCE, tier, prefix)
                theirs = digest_from_hex(digest_hex)
                out[tier] += [p.hex() for p in differing(prefix, mine, theirs)]
        self.digest_bytes += len(json.dumps({"instance_id": INSTANCE, "tiers": out}))
        return out

    def send(self, tier: str, backend: str, prefixes: tuple[str, ...], entries: list[Any]) -> None:
        self.seq += 1
        batch = EventBatch(
            INSTANCE, 1, self.seq, RESYNC, tier, backend, entries=tuple(entries), prefixes=prefixes
        )
        self.batch_bytes += len(encode_msgpack([batch]))
        self.batches += 1
        self.entries += len(entries)
        self.directory.consume(batch)

    def barrier(self, action: Any) -> None:
        send: SendResync = self.send
        action(send)


def _keys(rng: random.Random, n: int) -> list[ObjectKey]:
    rank = pack_kv_rank(1, 0, 1, 0)
    return [ObjectKey(rng.randbytes(32), "model", rank) for _ in range(n)]


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.placements = 20_000
    rng = random.Random(args.seed)
    n, drifted = args.placements, max(2, int(args.placements * args.drift))
    keys = _keys(rng, n + drifted // 2)
    held, ghosts = keys[:n], keys[n:]
    lost = set(rng.sample(range(n), drifted - len(ghosts)))
    inventory = NodeInventory()
    entries = [CacheEntry(k, 65536) for k in held]
    for e in entries:
        inventory.add(TIER, BACKEND, e)
    directory = KeyDirectory(args.chunk_size)
    believed = [e for i, e in enumerate(entries) if i not in lost] + [
        CacheEntry(k, 65536) for k in ghosts
    ]
    for seq, start in enumerate(range(0, len(believed), 1000), start=1):
        chunk = tuple(believed[start : start + 1000])
        directory.consume(EventBatch(INSTANCE, 1, seq, STORE, TIER, BACKEND, entries=chunk))

    wire = _Wire(directory)
    driver = ResyncDriver(
        inventory, {TIER: BACKEND}, exchange=wire.exchange, barrier=wire.barrier, interval=3600
    )
    started = time.perf_counter()
    report = driver.run_once()
    seconds = time.perf_counter() - started
    converged = directory.digest(INSTANCE, TIER) == inventory.digest(TIER)

    full = _Wire(KeyDirectory(args.chunk_size))
    every = tuple(f"{b:02x}" for b in range(BUCKETS))
    for start in range(0, BUCKETS, 1):  # one batch per root bucket: ~N/256 entries each
        prefix = every[start]
        listed = inventory.listing(TIER, [bytes.fromhex(prefix)])
        full.seq += 1
        batch = EventBatch(
            INSTANCE, 1, full.seq, RESYNC, TIER, BACKEND, entries=tuple(listed), prefixes=(prefix,)
        )
        full.batch_bytes += len(encode_msgpack([batch]))
        full.entries += len(listed)
    token_bytes = args.chunk_size * 4
    ours = wire.digest_bytes + wire.batch_bytes
    rows = [
        ("full listing", full.entries, 0, full.batch_bytes, full.batch_bytes + full.entries * token_bytes),
        ("resync (digests + differing prefixes)", wire.entries, wire.digest_bytes, ours,
         ours + wire.entries * token_bytes),
    ]  # fmt: skip
    title = f"resync of {n:,} placements, {drifted:,} drifted ({args.drift:.2%})"
    table = Table(title=title)
    for column in ("case", "entries", "digest bytes", "bytes (no tokens)", "bytes (with tokens)"):
        table.add_column(column, justify="right")
    for case, count, digest_bytes, plain, with_tokens in rows:
        table.add_row(case, f"{count:,}", f"{digest_bytes:,}", f"{plain:,}", f"{with_tokens:,}")
    table.add_row(
        "resync / full",
        f"{wire.entries / full.entries:.2%}",
        "",
        f"{ours / full.batch_bytes:.2%}",
        f"{rows[1][4] / rows[0][4]:.2%}",
    )
    Console(width=max(Console().width, 120)).print(table)
    print(
        f"exchange: {report.rounds} rounds, {report.prefixes} prefixes, {report.batches} batches, "
        f"{seconds:.3f} s; converged: {converged}"
    )
    if args.plot is not None:
        series = {"without tokens": [r[3] for r in rows], "with tokens": [r[4] for r in rows]}
        bar_chart(
            title, [r[0] for r in rows], series, "bytes sent (log scale)", args.plot, log=True
        )
    if args.json is not None:
        payload = {
            "placements": n, "drifted": drifted, "rounds": report.rounds,
            "prefixes": report.prefixes, "seconds": seconds, "converged": converged,
            "rows": [dict(zip(("case", "entries", "digest_bytes", "bytes", "bytes_with_tokens"),
                              row, strict=True)) for row in rows],
        }  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))
    return 0 if converged else 1
