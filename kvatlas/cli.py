"""The ``kvatlas`` command: ``coordinator``, ``node``, ``route``, ``demo`` and ``bench NAME``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvatlas.bench import BENCHMARKS
from kvatlas.client.route_client import ROUTE_HELP, RouteCommand, run_route_command
from kvatlas.config_flags import add_dataclass_arguments, dataclass_from_args
from kvatlas.coordinator.config import add_arguments as add_coordinator_arguments
from kvatlas.coordinator.config import config_from_args
from kvatlas.node.config import add_arguments as add_node_arguments
from kvatlas.node.config import config_from_args as node_config_from_args


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvatlas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    coordinator = sub.add_parser(
        "coordinator",
        help="run the coordinator service (every flag also as KVATLAS_<NAME>)",
        description="The fleet's key directory and blend index over HTTP.",
    )
    add_coordinator_arguments(coordinator)

    node = sub.add_parser(
        "node",
        help="run a cache node (every flag also as KVATLAS_<NAME>)",
        description="A cache node: KV tiers, peer L1, engine API, events to the coordinator.",
    )
    add_node_arguments(node)

    route = sub.add_parser(
        "route",
        help="score instances for a query (POST /route/score) and print the table",
        description="Which instance should serve this query: prefix and fragment coverage by tier.",
    )
    add_dataclass_arguments(route, RouteCommand, ROUTE_HELP)

    demo = sub.add_parser("demo", help="run the fleet demo (RAG workload over 2 nodes)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--processes", action="store_true", help="real processes over HTTP")
    demo.add_argument("--documents", type=int, default=24)
    demo.add_argument("--queries", type=int, default=40)
    demo.add_argument("--keys", action="store_true", help="show multimodal-safe keys instead")
    demo.add_argument(
        "--serve",
        action="store_true",
        help="then print the status page URL and keep the fleet up until Ctrl-C",
    )

    bench = sub.add_parser("bench", help="run a benchmark (median of repeats, ratio to naive)")
    bench_sub = bench.add_subparsers(dest="bench_name", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"kvatlas.bench.{name}")
        module.add_arguments(bench_sub.add_parser(name, help=module.__doc__))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "coordinator":
        from kvatlas.coordinator.server import run_coordinator

        try:
            config = config_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        return run_coordinator(config)
    if args.command == "node":
        from kvatlas.node.server import run_node

        try:
            node_config = node_config_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        return run_node(node_config)
    if args.command == "route":
        try:
            return run_route_command(dataclass_from_args(RouteCommand, args))
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
    if args.command == "demo":
        if args.keys:
            from kvatlas.demo.keys import run_demo

            return int(run_demo(seed=args.seed))
        from kvatlas.demo.fleet import run_fleet_demo

        return run_fleet_demo(
            seed=args.seed,
            processes=args.processes,
            documents=args.documents,
            queries=args.queries,
            serve_page=args.serve,
        )
    module = importlib.import_module(f"kvatlas.bench.{args.bench_name}")
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
