"""``kvatlas soak``: the chaos run of convergence.md §6 (docs/convergence.md).

Real processes (a redis-server, two coordinator replicas on the Redis transport, three nodes
with a small private fs L2 and one on a shared pool), a seeded workload through the engine
client with every served chunk checked against the toy model, seeded faults (``kill -9`` of
a node and of a replica, a Redis restart, a node paused past the instance timeout, an L2
filled past its cap), the time each takes to converge, and at the end every replica's
directory against the ground truth read from the nodes. Modules: ``fleet`` (processes),
``workload``, ``faults`` (the schedule), ``truth`` (ground truth and comparison), ``run``
(one run), ``report`` (targets, table). This module only declares the command line; the run
is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seconds", type=float, default=120.0,
        help="length of the workload and fault phase (then a quiet period and the final check)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the workload and of the fault schedule"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--workdir", type=Path, default=None,
        help="keep Redis data, snapshots, L2 directories and process logs here (default: a "
        "temporary directory, removed afterwards)",
    )  # fmt: skip
    parser.add_argument(
        "--stream-max-len", type=int, default=2000,
        help="the nodes' --stream-max-len (MAXLEN ~ of the event stream) during the run",
    )  # fmt: skip
    parser.add_argument(
        "--l2-chunks", type=int, default=40,
        help="private fs L2 cap of each node, in chunks (--l2-max-bytes = this x chunk bytes)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the soak; 0 when every judged target is met."""
    from kvatlas.soak.fleet import FleetSettings
    from kvatlas.soak.report import checks, show, with_verdicts
    from kvatlas.soak.run import Soak

    settings = FleetSettings(stream_max_len=args.stream_max_len, l2_chunks=args.l2_chunks)
    with tempfile.TemporaryDirectory(prefix="kvatlas-soak-") as tmp:
        root = Path(tmp) if args.workdir is None else args.workdir
        result = Soak(root, args.seconds, args.seed, settings).run()
    found = checks(result)
    show(result, found)
    final = with_verdicts(result, found)
    if args.json is not None:
        args.json.write_text(json.dumps(final, indent=2))
    return 0 if final["ok"] else 1


__all__ = ["add_arguments", "run"]
