"""The command line explains itself: every option of every subcommand has a help text,
choices show as ``{a,b}``, the top-level help is plain text, ``--version`` answers, and an
argument error prints the subcommand's usage. The walk finds every parser, so a flag added
later without a help text fails here."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvatlas import __version__
from kvatlas.cli import _build_parser, main
from kvatlas.errors import Unavailable

WHERE = (
    "add a help text: a config flag's goes in the HELP dict of kvatlas/node/config_help.py or "
    "the _HELP dict of kvatlas/coordinator/config.py, any other flag's in its "
    "add_argument(help=...) call"
)


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


PARSERS = dict(_parsers(_build_parser()))


def test_the_walk_reaches_every_subcommand() -> None:
    names = {" ".join(path) for path in PARSERS}
    assert {"coordinator", "node", "demo", "keys kv-rank", "bench keys", "bench service"} <= names


def test_every_option_has_a_help_text() -> None:
    missing = [
        f"kvatlas {' '.join(path)} {action.option_strings[-1]}"
        for path, parser in PARSERS.items()
        for action in parser._actions
        if action.option_strings
        and action.help is not argparse.SUPPRESS
        # a config flag without a _HELP entry still has its "[env ...; default ...]" tail
        and not (action.help or "").split("[env ")[0].strip()
    ]
    assert not missing, f"options without help: {missing}; {WHERE}"


def test_choices_show_as_a_set() -> None:
    usage = PARSERS[("node",)].format_usage()
    assert "--hash-scheme {blake3,blake3-x1}" in usage
    assert "HASH_SCHEME" not in usage
    assert "--log-format {json,text}" in PARSERS[("coordinator",)].format_usage()


def test_top_level_help_is_plain_text() -> None:
    for parser in (PARSERS[()], PARSERS[("bench",)]):
        assert "``" not in parser.format_help()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvatlas {__version__}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["node", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["node", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--rank", "3"],
            "global_rank",
        ),
        (["coordinator", "--port", "0"], "--port must be >= 1"),
        (["keys", "kv-rank", "--world-size", "0"], "world_size"),
    ],
)
def test_argument_errors_print_the_subcommands_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert err.startswith(f"usage: kvatlas {command} "), err
    assert message in err


def test_keys_kv_rank_prints_the_packed_rank() -> None:
    """The kv_rank of docs/keys.md's keys-form lookup example (rank 0 of 1)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli", "keys", "kv-rank", "--world-size", "1", "--rank", "0"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.strip() == "16777472"


@pytest.mark.parametrize("path", sorted(PARSERS), ids=lambda p: " ".join(p) or "kvatlas")
def test_every_commands_help_renders(path: tuple[str, ...]) -> None:
    """``--help`` formats every flag's help (a bare ``%`` in one crashed ``engine-sim --help``)."""
    assert PARSERS[path].format_help()


@pytest.mark.parametrize("command", [p[0] for p in PARSERS if len(p) == 1])
def test_one_commands_parser_is_that_command_of_the_whole_parser(command: str) -> None:
    """``main`` builds only the chosen command's flags (the others' modules stay unimported):
    the command parses and explains itself exactly as in the parser of every command."""
    alone = dict(_parsers(_build_parser(command)))
    ours = {path: p for path, p in PARSERS.items() if path[:1] == (command,)}
    assert {path: p.format_help() for path, p in alone.items() if path[:1] == (command,)} == {
        path: p.format_help() for path, p in ours.items()
    }
    assert alone[()].format_help() == PARSERS[()].format_help()


def test_a_service_that_cannot_start_says_why_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A service's own error at start (``--kv-events-subscribe nonsense``: an endpoint ZMQ
    refuses when the coordinator opens its sockets, a bind port in use, ...) ended the process
    with a Python traceback; now one line naming it, exit 1 (checked by hand against a real
    coordinator: ``kvatlas coordinator: error: --kv-events-subscribe / --kv-events-bind:
    Invalid argument (addr='nonsense')``)."""
    from kvatlas.coordinator import server

    def refused(*_: object) -> int:
        raise Unavailable("--kv-events-subscribe / --kv-events-bind: Invalid argument")

    monkeypatch.setattr(server, "run_coordinator", refused)
    assert main(["coordinator", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == "kvatlas coordinator: error: --kv-events-subscribe / --kv-events-bind: Invalid argument\n"
    )
