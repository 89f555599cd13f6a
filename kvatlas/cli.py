"""The ``kvatlas`` command: ``coordinator``, ``node``, ``router``, ``route``, ``engine-sim``,
``demo``, ``keys``, ``soak`` and ``bench NAME``."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvatlas import __version__
from kvatlas.bench import BENCHMARKS
from kvatlas.config_flags import FlagParser
from kvatlas.errors import KvatlasError

if TYPE_CHECKING:
    from kvatlas.client.mp_server_client import MPServerClient
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.router_replica import RouterLaunch

DESCRIPTION = (
    "kvatlas: where every cached KV chunk of an LLM serving fleet lives. Run a coordinator "
    "(the fleet's directory), cache nodes (KV tiers and an engine API), the demo, a key "
    "helper or a benchmark; 'kvatlas COMMAND --help' explains each command's flags."
)


def _plain(doc: str | None) -> str:
    """A docstring's first paragraph as plain text (no reST backticks, one line)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.replace("``", "").split())


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported when first called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


def _router_flags(router: argparse.ArgumentParser) -> None:
    from kvatlas.router.config import add_arguments
    from kvatlas.router_replica import add_arguments as add_replica_arguments

    add_arguments(router)
    add_replica_arguments(router)


def _route_flags(route: argparse.ArgumentParser) -> None:
    from kvatlas.client.route_client import ROUTE_HELP, ROUTE_RENAMED_FLAGS, RouteCommand
    from kvatlas.config_flags import add_dataclass_arguments

    add_dataclass_arguments(route, RouteCommand, ROUTE_HELP, renamed=ROUTE_RENAMED_FLAGS)


def _demo_flags(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    demo.add_argument("--processes", action="store_true", help="real processes over HTTP")
    demo.add_argument("--documents", type=int, default=24, help="documents in the corpus")
    demo.add_argument("--queries", type=int, default=40, help="queries, each over a few documents")
    demo.add_argument("--keys", action="store_true", help="show multimodal-safe keys instead")
    demo.add_argument(
        "--serve",
        action="store_true",
        help="then print the status page URL and keep the fleet up until Ctrl-C",
    )


def _keys_flags(keys: argparse.ArgumentParser) -> None:
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="HELPER")
    kv_rank = keys_sub.add_parser(
        "kv-rank",
        help="print the packed kv_rank of a tensor-parallel rank (a key's kv_rank field)",
        description="Print world_size<<24 | rank<<16 | world_size<<8 | rank: the kv_rank "
        "that a node with --world-size and --rank puts in its keys.",
    )
    kv_rank.add_argument("--world-size", type=int, default=1, help="tensor-parallel world size")
    kv_rank.add_argument("--rank", type=int, default=0, help="the tensor-parallel rank")


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_name", required=True, metavar="NAME")
    for name in BENCHMARKS:
        module = importlib.import_module(f"kvatlas.bench.{name}")
        doc = _plain(module.__doc__)
        module.add_arguments(bench_sub.add_parser(name, help=doc, description=doc))


class _Command(NamedTuple):
    help: str
    description: str | None
    add_flags: Callable[[argparse.ArgumentParser], None]


_COMMANDS: dict[str, _Command] = {
    "coordinator": _Command(
        "run the coordinator service (every flag also as KVATLAS_<NAME>)",
        "The fleet's key directory and blend index over HTTP (docs/coordinator.md).",
        _lazy("kvatlas.coordinator.config", "add_arguments"),
    ),
    "node": _Command(
        "run a cache node (every flag also as KVATLAS_<NAME>)",
        "A cache node: KV tiers, peer L1, engine API, events to the coordinator (docs/node.md).",
        _lazy("kvatlas.node.config", "add_arguments"),
    ),
    "router": _Command(
        "run the OpenAI-compatible router in front of vLLM engines (every flag also as "
        "KVATLAS_<NAME>)",
        "Routes each request to the engine with the lowest predicted time to first "
        "token, from what the directory says each engine can reuse (docs/router.md).",
        _router_flags,
    ),
    "route": _Command(
        "score instances for a query (POST /route/score) and print the table",
        "Which instance should serve this query: prefix and fragment coverage by tier.",
        _route_flags,
    ),
    "cache": _Command(
        "cache control: pins, deletes, prefetches, moves, quotas (docs/cache-control.md)",
        None,
        _lazy("kvatlas.client.cache_cli", "add_arguments"),
    ),
    "engine-sim": _Command(
        "run one simulated vLLM engine (every flag also as KVATLAS_<NAME>)",
        "One simulated vLLM engine: vLLM's OpenAI API, /metrics, paged prefix "
        "cache and KV events over ZMQ, timed by a cost model (docs/engine-sim.md).",
        _lazy("kvatlas.engine_sim.config", "add_arguments"),
    ),
    "demo": _Command(
        "run the fleet demo (RAG workload over 2 nodes)",
        "A RAG workload over a coordinator and two cache nodes, in one process "
        "(default) or real processes over HTTP; --keys shows multimodal-safe keys instead.",
        _demo_flags,
    ),
    "keys": _Command("key helpers (docs/keys.md)", "Helpers for kvatlas keys.", _keys_flags),
    "soak": _Command(
        "the chaos run: real fleet, seeded faults, directory vs ground truth",
        "The chaos run of convergence.md section 6 (docs/convergence.md).",
        _lazy("kvatlas.soak", "add_arguments"),
    ),
    "bench": _Command("run a benchmark (median of repeats, ratio to naive)", None, _bench_flags),
}
"""Every subcommand: its help line, description, and what adds its flags (importing what
they need: a service started as ``kvatlas coordinator`` imports the coordinator's modules,
not every command's)."""


def _build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command's parser: every subcommand listed; the flags of subcommand ``only``
    (``None``: of every subcommand; ``""``: of none, for a command line naming none, whose
    ``--help``, ``--version`` or error needs no subcommand's flags)."""
    parser = FlagParser(prog="kvatlas", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvatlas {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in _COMMANDS.items():
        own = sub.add_parser(name, help=command.help, description=command.description)
        if only is None or name == only:
            command.add_flags(own)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word not an option, the top level having
    only ``-h`` and ``--version``), ``None`` if none or not one of :data:`_COMMANDS`."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in _COMMANDS else None


def subcommand_parser(
    parser: argparse.ArgumentParser, names: Sequence[str]
) -> argparse.ArgumentParser:
    """The parser of ``kvatlas NAMES...`` (the deepest one ``names`` reaches)."""
    for name in names:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or name not in actions[0].choices:
            break
        parser = actions[0].choices[name]
    return parser


MP_SERVER_TIMEOUT_S = 10.0
"""How long the coordinator waits for an MP server's answer to a cache-control call."""


def mp_servers(config: CoordinatorConfig) -> Callable[[str], MPServerClient]:
    """The MP-server client the coordinator delivers cache-control commands with, sending
    ``--node-token-file``'s token (the coordinator package does not import the client
    package: handed in from here)."""
    from kvatlas.client.mp_server_client import MPServerClient

    token = config.node_bearer()
    return lambda url: MPServerClient(url, timeout=MP_SERVER_TIMEOUT_S, token=token)


def run_coordinator(config: CoordinatorConfig) -> int:
    """``kvatlas coordinator``, delivering cache-control commands with :func:`mp_servers`."""
    from kvatlas.coordinator.server import run_coordinator as run

    return run(config, mp_servers(config))


def run_router(launch: RouterLaunch) -> int:
    """``kvatlas router`` (with ``--scores-from replica``, a coordinator replica in it)."""
    from kvatlas.router_replica import run

    return run(launch)


_SERVICES: dict[str, tuple[str, str, Callable[[argparse.Namespace], object]]] = {
    "coordinator": ("kvatlas.cli", "run_coordinator",
                    _lazy("kvatlas.coordinator.config", "config_from_args")),
    "node": ("kvatlas.node.server", "run_node", _lazy("kvatlas.node.config", "config_from_args")),
    "router": ("kvatlas.cli", "run_router", _lazy("kvatlas.router_replica", "launch_from_args")),
    "engine-sim": ("kvatlas.engine_sim.server", "run_engine_sim",
                   _lazy("kvatlas.engine_sim.config", "config_from_args")),
}  # fmt: skip
"""The long-running services: ``kvatlas <name>`` → (module, its run function, the config)."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _build_parser(_command_in(argv) or "")
    args, extra = parser.parse_known_args(argv)
    names = [args.command, getattr(args, "bench_name", None) or getattr(args, "keys_command", "")]
    own = subcommand_parser(parser, [n for n in names if n])
    if extra:  # argument errors name the subcommand's usage, not the top level's
        own.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in _SERVICES:  # parsed here, imported (and run) only when chosen
        where, entry, parse = _SERVICES[args.command]
        try:
            config = parse(args)
        except ValueError as exc:
            own.error(str(exc))
        try:
            result: int = getattr(importlib.import_module(where), entry)(config)
        except KvatlasError as exc:  # (a socket it cannot open, ...: said, not a traceback)
            print(f"kvatlas {args.command}: error: {exc}", file=sys.stderr)
            return 1
        return result
    if args.command == "route":
        from kvatlas.client.route_client import (
            ROUTE_RENAMED_FLAGS,
            RouteCommand,
            run_route_command,
        )
        from kvatlas.config_flags import dataclass_from_args

        try:
            command = dataclass_from_args(RouteCommand, args, renamed=ROUTE_RENAMED_FLAGS)
            return run_route_command(command)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
    if args.command == "cache":
        from kvatlas.client import cache_cli

        return cache_cli.run(args)
    if args.command == "keys":
        from kvatlas.keys import pack_kv_rank

        try:
            print(pack_kv_rank(args.world_size, args.rank, args.world_size, args.rank))
        except ValueError as exc:
            own.error(str(exc))
        return 0
    from kvatlas.processes import Interrupted, sigterm_as_interrupt

    with sigterm_as_interrupt():  # the rest start processes: stopped on SIGTERM as on Ctrl-C
        try:
            return _run_with_processes(args)
        except KeyboardInterrupt as exc:
            name = " ".join(n for n in names if n)
            print(f"kvatlas {name}: interrupted; the processes it started are stopped",
                  file=sys.stderr)  # fmt: skip
            return 128 + (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)


def _run_with_processes(args: argparse.Namespace) -> int:
    """``demo``, ``soak`` and ``bench NAME``: each starts services of its own and stops them
    in its ``finally`` blocks."""
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
    if args.command == "soak":
        from kvatlas.soak import run as run_soak

        return run_soak(args)
    from kvatlas.bench.common import warn_if_busy

    warn_if_busy(args.bench_name)
    module = importlib.import_module(f"kvatlas.bench.{args.bench_name}")
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
