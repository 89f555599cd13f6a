"""``kvatlas cache ACTION``: the coordinator's cache control from the command line
(``docs/cache-control.md``, "Command line") — pin, unpin, pins, delete, prefetch and
prefetch-status, move and move-status, and quota get|set|delete|list|config — through
:class:`~kvatlas.client.cache_client.CacheControlClient`.

Every action names its coordinator as nodes and routers do (``--coordinator-url``,
``--coordinator-token`` or ``--coordinator-token-file``, each also ``KVATLAS_<NAME>``).
A refusal prints the coordinator's status and ``detail`` and exits 1; a bad command line
exits 2; ``--wait`` that gives up exits 3 (the command is still running on the coordinator);
a move that failed exits 4. ``--json PATH`` also writes the reply as the coordinator sent
it (``-``: to standard output instead of the text).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from kvatlas.api.cache_control import MAX_PIN_PAGE
from kvatlas.auth import read_secret
from kvatlas.checks import check_http_url
from kvatlas.client.cache_actions import (
    ACTIONS,
    EXIT_REFUSED,
    EXIT_USAGE,
    Out,
    UsageError,
)
from kvatlas.client.cache_client import CacheControlClient
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.config_flags import add_dataclass_arguments, dataclass_from_args


@dataclass(frozen=True)
class CoordinatorLink:
    """Where every ``kvatlas cache`` action goes (each flag also ``KVATLAS_<NAME>``, the
    names nodes and routers use for the same settings)."""

    coordinator_url: str = "http://127.0.0.1:9300"
    coordinator_token: str | None = None
    coordinator_token_file: Path | None = None

    def token(self) -> str | None:
        given = self.coordinator_token or ""
        return read_secret(given, self.coordinator_token_file, "--coordinator-token")

    def client(self) -> CacheControlClient:
        url = check_http_url(self.coordinator_url, "--coordinator-url")
        return CacheControlClient(url, token=self.token())


LINK_HELP = {
    "coordinator_url": "coordinator base URL",
    "coordinator_token": "bearer token: admin, or a 'cache' token bound to the salts acted on "
    "(prefer the file or the environment: a flag shows in the process list)",
    "coordinator_token_file": "file holding the token (mode 600, >= 32 characters)",
}


# ---------------------------------------------------------------------------- the parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvatlas cache``'s actions, each with its flags."""
    actions = parser.add_subparsers(dest="cache_action", required=True, metavar="ACTION")

    def action(name: str, text: str) -> argparse.ArgumentParser:
        return _common(actions.add_parser(name, help=text, description=text))

    _tokens(action("pin", "pin the keys of tokens (one more pin each; a pinned key is not "
                   "deleted without --force nor evicted)"))  # fmt: skip
    _tokens(action("unpin", "unpin the keys of tokens (one pin fewer each, floored at 0)"))
    pins = action("pins", "list pinned keys, first pinned first (paged)")
    pins.add_argument(
        "--cache-salt", default=None,
        help="only this salt's pins ('' the empty salt's; default every salt's)",
    )  # fmt: skip
    pins.add_argument("--model-name", default="", help="only this model's pins")
    pins.add_argument("--offset", type=int, default=0, help="rows to skip")
    pins.add_argument("--limit", type=int, default=1000, help=f"rows per page (1-{MAX_PIN_PAGE:,})")
    pins.add_argument("--all", action="store_true", help="every page, not only one")

    delete = _tokens(action("delete", "delete the keys of tokens from an instance (carried "
                            "out even if the instance is down now)"))  # fmt: skip
    delete.add_argument("--instance-id", required=True, help="the instance that holds them")
    delete.add_argument(
        "--tier", choices=("l1", "l2", "all"), default="all", help="which of its tiers"
    )
    delete.add_argument("--force", action="store_true", help="delete pinned keys too")

    prefetch = _waits(_tokens(action("prefetch", "load the keys of tokens from an "
                                     "instance's L2 into its L1")))  # fmt: skip
    prefetch.add_argument("--instance-id", required=True, help="the instance to warm")
    prefetch_status = _waits(action("prefetch-status", "where a prefetch stands"))
    prefetch_status.add_argument("--instance-id", required=True, help="the prefetch's instance")
    prefetch_status.add_argument("--request-id", required=True, help="the prefetch's request_id")

    move = _waits(_tokens(action("move", "move the keys of tokens from one instance's L1 to "
                                 "another's (the target's copy is held until the source's "
                                 "is deleted)")))  # fmt: skip
    move.add_argument("--source-instance-id", required=True, help="where the keys are")
    move.add_argument("--target-instance-id", required=True, help="where they should be")
    move.add_argument("--keep-source", action="store_true", help="a copy: keep the source's")
    move_status = _waits(action("move-status", "where a move stands"))
    move_status.add_argument("--move-id", required=True, help="the move's move_id")

    quota = actions.add_parser(
        "quota", help="quotas per cache salt (get, set, delete, list, config)",
        description="Each salt's limit on the bytes its keys hold in L2 (GB of 2^30 bytes); "
        "over it, the fleet evicts its keys.",
    )  # fmt: skip
    verbs = quota.add_subparsers(dest="quota_action", required=True, metavar="VERB")

    def verb(name: str, text: str) -> argparse.ArgumentParser:
        return _common(verbs.add_parser(name, help=text, description=text))

    salt_help = "the salt ('' names the empty salt)"
    verb("get", "a salt's own quota and its usage").add_argument(
        "--cache-salt", required=True, help=salt_help
    )
    set_ = verb("set", "set a salt's own quota")
    set_.add_argument("--cache-salt", required=True, help=salt_help)
    set_.add_argument(
        "--limit-gb", type=float, required=True, help="GB of 2^30 bytes (0: it may hold nothing)"
    )
    verb("delete", "remove a salt's own quota (the default applies again)").add_argument(
        "--cache-salt", required=True, help=salt_help
    )
    verb("list", "every salt's quota and usage, and the default")
    verb("config", "show the default quota, or set it with --default-limit-gb").add_argument(
        "--default-limit-gb", default=None, metavar="GB|none",
        help="the quota of salts without their own ('none': they are exempt)",
    )  # fmt: skip


def _common(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every action's flags: where the coordinator is, and ``--json``."""
    add_dataclass_arguments(sub, CoordinatorLink, LINK_HELP)
    sub.add_argument(
        "--json", type=Path, default=None, metavar="PATH",
        help="also write the reply as JSON here ('-': to standard output, instead of text)",
    )  # fmt: skip
    return sub


def _tokens(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model-name", required=True, help="model the KV was computed with")
    parser.add_argument("--world-size", type=int, default=1, help="tensor-parallel world size")
    parser.add_argument("--cache-salt", default="", help="the salt (tenant) of the keys")
    parser.add_argument(
        "--token-ids", default=None, help="token ids, separated by commas or spaces"
    )
    parser.add_argument(
        "--tokens-file", type=Path, default=None,
        help="token ids: a JSON list, or integers separated by spaces/commas (/dev/stdin reads "
        "standard input)",
    )  # fmt: skip
    return parser


def _waits(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--wait", action="store_true", help="poll until it ends, showing progress on stderr"
    )
    parser.add_argument(
        "--wait-timeout-s", type=float, default=600.0,
        help="give up waiting after this long (exit 3; the command goes on)",
    )  # fmt: skip
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="between polls")
    return parser


# ---------------------------------------------------------------------------- running


def run(args: argparse.Namespace) -> int:
    """Run the action; its exit code (module docstring)."""
    name = " ".join(n for n in ("cache", args.cache_action, getattr(args, "quota_action", "")) if n)
    try:
        link = dataclass_from_args(CoordinatorLink, args)
        _check_args(args)
        with link.client() as client:
            return ACTIONS[args.cache_action](client, args, Out(args.json))
    except ValueError as exc:  # the token file, a URL, a flag's value
        print(f"kvatlas {name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CoordinatorError as exc:
        print(f"kvatlas {name}: {exc}{_hint(exc.reply_status, args.cache_action)}", file=sys.stderr)  # fmt: skip
        return EXIT_REFUSED


def _hint(status: int | None, action: str) -> str:
    if status == 502 and action in ("delete", "prefetch"):
        return (
            " (the coordinator recorded the command: it retries it until the instance takes "
            "it; its status is on the status page)"
        )
    if status == 401:
        return " (give --coordinator-token-file, --coordinator-token or KVATLAS_COORDINATOR_TOKEN)"
    if status is None:
        return " (is the coordinator running at --coordinator-url?)"
    return ""


def _check_args(args: argparse.Namespace) -> None:
    waits = (getattr(args, "wait_timeout_s", 1.0), getattr(args, "poll_interval_s", 1.0))
    if not all(math.isfinite(s) and s > 0 for s in waits):  # NaN: sleep() refuses it only
        # after the command was sent, and a timeout of NaN never ends the wait
        raise UsageError("--wait-timeout-s and --poll-interval-s must be finite numbers > 0")
    if getattr(args, "world_size", 1) < 1:
        raise UsageError("--world-size must be >= 1")
    for name in (
        "instance_id",
        "request_id",
        "move_id",
        "source_instance_id",
        "target_instance_id",
    ):
        if getattr(args, name, None) == "":  # `GET /cache/moves/` is the listing: a traceback
            raise UsageError(f"--{name.replace('_', '-')} is empty: give the id")
