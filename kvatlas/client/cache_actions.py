"""The actions of ``kvatlas cache`` (:mod:`kvatlas.client.cache_cli` parses and runs them):
each takes the client, the parsed arguments and where its output goes, prints the result as
text (or the reply as JSON) and returns its exit code."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final, TextIO, TypeVar

import msgspec

from kvatlas.api.cache_control import (
    MAX_PIN_PAGE,
    CoordinatorPrefetchStatus,
    MoveStatus,
    PinsReply,
    QuotaConfig,
    QuotaStatus,
    TokenFields,
)
from kvatlas.checks import is_plain_int
from kvatlas.client.cache_client import CacheControlClient, token_fields, wait_for_status
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.client.route_client import read_tokens

EXIT_REFUSED: Final = 1
"""The coordinator refused (its 4xx/5xx ``detail`` is printed) or could not be reached."""
EXIT_USAGE: Final = 2
EXIT_STILL_PENDING: Final = 3
"""``--wait`` gave up after ``--wait-timeout-s``; the command goes on on the coordinator."""
EXIT_FAILED: Final = 4
"""The command ended ``failed`` (a move whose instance left, say)."""
GB: Final = float(1 << 30)
S = TypeVar("S")
_PROGRESS_EVERY_S: Final = 10.0  # a line at least this often when stderr is not a terminal


class UsageError(ValueError):
    """A bad command line the parser cannot see (exit 2)."""


class Out:
    """Text to stdout, and the reply as JSON to ``--json`` (``-``: JSON instead of text)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.text = path is None or str(path) != "-"
        if self.text and path is not None:  # refused before anything is sent
            try:
                path.touch()
            except OSError as exc:
                raise UsageError(f"--json: cannot write {path}: {exc.strerror}") from None

    def say(self, line: str) -> None:
        if self.text:
            print(line)

    def reply(self, value: object) -> None:
        if self.path is None:
            return
        data = json.dumps(msgspec.to_builtins(value), indent=2) + "\n"
        if str(self.path) == "-":
            sys.stdout.write(data)
        else:
            self.path.write_text(data)


def _fields(args: argparse.Namespace) -> TokenFields:
    if (args.token_ids is None) == (args.tokens_file is None):
        raise UsageError("give the tokens: --token-ids or --tokens-file (one of them)")
    if args.tokens_file is not None:
        try:
            ids = read_tokens(args.tokens_file)
        except OSError as exc:
            why = f"cannot read {args.tokens_file}: {exc.strerror}"
            raise UsageError(f"--tokens-file: {why}") from None
    else:
        try:
            ids = [int(t) for t in args.token_ids.replace(",", " ").split()]
        except ValueError:
            raise UsageError("--token-ids: integers separated by commas or spaces") from None
    if not all(is_plain_int(t) and abs(t) < 1 << 63 for t in ids):
        raise UsageError("token ids must be integers (of at most 63 bits)")
    if not ids:  # an empty variable or file: the action would do nothing, and say it did
        given = "--tokens-file" if args.tokens_file is not None else "--token-ids"
        raise UsageError(f"{given}: no token ids given")
    return token_fields(
        args.model_name, ids, world_size=args.world_size, cache_salt=args.cache_salt
    )


def _salt(salt: str) -> str:
    return repr(salt) if salt else "'' (the empty salt)"


# ------------------------------------------------------------------ pins


def _pin(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    reply = client.pin(_fields(args))
    out.reply(reply)
    out.say(f"pinned: {reply.affected} keys of {reply.requested} complete chunks")
    return 0


def _unpin(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    reply = client.unpin(_fields(args))
    out.reply(reply)
    out.say(f"unpinned: {reply.affected} keys of {reply.requested} complete chunks")
    return 0


def _pins(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    if not 1 <= args.limit <= MAX_PIN_PAGE or args.offset < 0:
        raise UsageError(f"--limit must be 1-{MAX_PIN_PAGE:,} and --offset >= 0")
    page = client.pins(args.cache_salt, args.model_name, args.offset, args.limit)
    rows = list(page.pins)
    while args.all and page.pins and args.offset + len(rows) < page.total:
        page = client.pins(args.cache_salt, args.model_name, args.offset + len(rows), args.limit)
        rows += page.pins
    listed = PinsReply(page.total, rows)
    out.reply(listed)
    first = args.offset + 1 if rows else args.offset
    out.say(f"pinned keys {first}-{args.offset + len(rows)} of {listed.total}")
    if rows:
        out.say("pins  cache_salt  model_name  kv_rank  chunk_hash_hex")
    for row in rows:
        k = row.key
        salt = k.cache_salt or "-"
        out.say(f"{row.pin_count:>4}  {salt}  {k.model_name}  {k.kv_rank}  {k.chunk_hash_hex}")
    if args.offset + len(rows) < listed.total:
        out.say(f"more: --offset {args.offset + len(rows)} (or --all)")
    return 0


# ------------------------------------------------------------------ delete, prefetch, moves


def _delete(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    reply = client.delete(args.instance_id, _fields(args), args.tier, force=args.force)
    out.reply(reply)
    out.say(
        f"{reply.status}: {reply.affected} keys sent to {reply.instance_id} ({args.tier}), "
        f"{reply.skipped} pinned skipped, of {reply.requested} complete chunks"
    )
    if reply.skipped and not args.force:
        out.say("pinned keys stay: unpin them, or --force")
    return 0


def _prefetch(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    try:
        reply = client.prefetch(args.instance_id, _fields(args))
    except CoordinatorError as exc:  # a 502 whose command the coordinator kept and retries:
        if not (args.wait and exc.reply_status == 502 and exc.request_id):  # waited on, as a
            raise  # move to a target that is down is
        print(f"kvatlas cache prefetch: {exc}; waiting for it", file=sys.stderr)
        return _wait_prefetch(client, args, out, args.instance_id, exc.request_id)
    if reply.status == "noop" or not args.wait:
        out.reply(reply)
        out.say(f"{reply.status}: {reply.chunks} chunks to {reply.instance_id}'s L1")
        if reply.status == "submitted":
            out.say(f"request_id {reply.request_id} (kvatlas cache prefetch-status "
                    f"--instance-id {reply.instance_id} --request-id {reply.request_id})")  # fmt: skip
        return 0
    out.say(f"submitted: {reply.chunks} chunks, request_id {reply.request_id}")
    return _wait_prefetch(client, args, out, reply.instance_id, reply.request_id)


def _prefetch_status(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    if args.wait:
        return _wait_prefetch(client, args, out, args.instance_id, args.request_id)
    status = client.prefetch_status(args.instance_id, args.request_id)
    out.reply(status)
    out.say(_prefetch_text(status))
    return 0


def _prefetch_text(s: CoordinatorPrefetchStatus) -> str:
    if s.status != "completed":
        return s.status
    return f"completed: {s.found_keys} of {s.total_keys} keys in L1"


def _wait_prefetch(
    client: CacheControlClient, args: argparse.Namespace, out: Out, instance: str, request: str
) -> int:
    status, ended = _wait(
        args, f"prefetch {request}", lambda: client.prefetch_status(instance, request),
        lambda s: s.status == "completed", _prefetch_text,
    )  # fmt: skip
    out.reply(status)
    out.say(_prefetch_text(status) if ended else _gave_up(args, status.status))
    return 0 if ended else EXIT_STILL_PENDING


def _move(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    reply = client.move(
        args.source_instance_id, args.target_instance_id, _fields(args),
        keep_source=args.keep_source,
    )  # fmt: skip
    if reply.status == "noop" or not args.wait:
        out.reply(reply)
        named = f", move_id {reply.move_id}" if reply.move_id else ""
        route = f"{reply.source_instance_id} -> {reply.target_instance_id}"
        out.say(f"{reply.status}: {reply.requested} chunks {route}{named}")
        return 0
    out.say(f"recorded: {reply.requested} chunks, move_id {reply.move_id}")
    return _wait_move(client, args, out, reply.move_id)


def _move_status(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    if args.wait:
        return _wait_move(client, args, out, args.move_id)
    status = client.move_status(args.move_id)
    out.reply(status)
    out.say(_move_text(status))
    return EXIT_FAILED if status.status == "failed" else 0


def _move_text(s: MoveStatus) -> str:
    text = (
        f"{s.status} ({s.phase}): {s.loaded} keys loaded on {s.target_instance_id}, "
        f"{s.missing} missing, {s.deleted} deleted from {s.source_instance_id}, "
        f"{s.skipped} skipped, of {s.requested} chunks"
    )
    return text + (f"; error: {s.error}" if s.error else "")


def _wait_move(client: CacheControlClient, args: argparse.Namespace, out: Out, move_id: str) -> int:
    status, ended = _wait(
        args, f"move {move_id}", lambda: client.move_status(move_id),
        lambda s: s.status != "pending", _move_text,
    )  # fmt: skip
    out.reply(status)
    if not ended:
        out.say(_gave_up(args, f"{status.status} ({status.phase})"))
        return EXIT_STILL_PENDING
    out.say(_move_text(status))
    return EXIT_FAILED if status.status == "failed" else 0


def _gave_up(args: argparse.Namespace, state: str) -> str:
    return f"still {state} after --wait-timeout-s {args.wait_timeout_s:g}; it goes on"


def _wait(
    args: argparse.Namespace,
    what: str,
    poll: Callable[[], S],
    finished: Callable[[S], bool],
    text: Callable[[S], str],
) -> tuple[S, bool]:
    progress = _Progress(what, sys.stderr)
    try:
        return wait_for_status(
            poll, finished, timeout_s=args.wait_timeout_s, interval_s=args.poll_interval_s,
            on_status=lambda s, elapsed: progress.show(text(s), elapsed),
        )  # fmt: skip
    finally:
        progress.close()


class _Progress:
    """Where a long command stands, on stderr: one line rewritten in place on a terminal;
    otherwise a line at each change, and at least every 10 s (a log shows it is alive)."""

    def __init__(self, what: str, stream: TextIO) -> None:
        self.what, self.stream = what, stream
        self.tty = stream.isatty()
        self.last: str | None = None
        self.last_at = 0.0

    def show(self, text: str, elapsed_s: float) -> None:
        line = f"{self.what}: {text} ({elapsed_s:.0f} s)"
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K")
        elif text != self.last or elapsed_s - self.last_at >= _PROGRESS_EVERY_S:
            self.stream.write(line + "\n")
            self.last_at = elapsed_s
        self.last = text
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------ quotas


def _quota(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    return _QUOTA[args.quota_action](client, args, out)


def _usage(gb: float) -> str:
    n = gb * GB
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _limit_gb(gb: float | None) -> str:
    return "none (exempt)" if gb is None else f"{gb:g} GB"


def _status_text(s: QuotaStatus, default: float | None = None) -> str:
    limit = s.quota_limit_gb if s.quota_exists else default
    own = "own" if s.quota_exists else "default"
    used = f"usage {_usage(s.usage_gb)}"
    if limit is None:
        return f"{_salt(s.cache_salt)}: no quota ({own}: exempt), {used}"
    ratio = f" ({100 * s.usage_gb / limit:.1f}%)" if limit > 0 else ""
    return f"{_salt(s.cache_salt)}: limit {limit:g} GB ({own}), {used}{ratio}"


def _quota_get(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    status = client.quota(args.cache_salt)
    out.reply(status)
    if status.quota_exists:
        out.say(_status_text(status))
    else:
        out.say(f"{_salt(status.cache_salt)}: no quota of its own (the default applies), "
                f"usage {_usage(status.usage_gb)}")  # fmt: skip
    return 0


def _quota_set(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    if not (math.isfinite(args.limit_gb) and args.limit_gb >= 0):
        raise UsageError("--limit-gb must be a finite number >= 0")
    reply = client.set_quota(args.cache_salt, args.limit_gb)
    out.reply(reply)
    out.say(f"{_salt(reply.cache_salt)}: quota {reply.limit_gb:g} GB")
    return 0


def _quota_delete(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    reply = client.remove_quota(args.cache_salt)
    out.reply(reply)
    if reply.status == "not_found":
        print(f"kvatlas cache quota delete: no quota for cache_salt={reply.cache_salt!r}",
              file=sys.stderr)  # fmt: skip
        return 1
    out.say(f"{_salt(reply.cache_salt)}: quota removed (the default applies)")
    return 0


def _quota_list(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    listed = client.quotas()
    default = client.quota_config().default_limit_gb
    out.reply(listed)
    out.say(f"default quota: {_limit_gb(default)}; total usage {_usage(listed.total_gb)}")
    for s in listed.by_cache_salt:
        out.say(_status_text(s, default))
    return 0


def _quota_config(client: CacheControlClient, args: argparse.Namespace, out: Out) -> int:
    given: str | None = args.default_limit_gb
    config: QuotaConfig
    if given is None:
        config = client.quota_config()
    else:
        config = client.set_quota_config(_parse_limit(given))
    out.reply(config)
    out.say(f"default quota: {_limit_gb(config.default_limit_gb)}")
    return 0


def _parse_limit(text: str) -> float | None:
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--default-limit-gb: a number of GB or 'none', got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise UsageError("--default-limit-gb must be a finite number >= 0 (or 'none')")
    return value


_Action = Callable[[CacheControlClient, argparse.Namespace, Out], int]
ACTIONS: dict[str, _Action] = {
    "pin": _pin,
    "unpin": _unpin,
    "pins": _pins,
    "delete": _delete,
    "prefetch": _prefetch,
    "prefetch-status": _prefetch_status,
    "move": _move,
    "move-status": _move_status,
    "quota": _quota,
}
_QUOTA: dict[str, _Action] = {
    "get": _quota_get,
    "set": _quota_set,
    "delete": _quota_delete,
    "list": _quota_list,
    "config": _quota_config,
}
