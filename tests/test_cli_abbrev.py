"""No command accepts an abbreviated flag: ``--num-kv-head 2`` is an error, not
``--num-kv-heads 2`` (an abbreviation that works today breaks when a longer flag is added)."""

from __future__ import annotations

import argparse

import pytest

from kvatlas.cli import _build_parser
from kvatlas.coordinator.config import parse_config


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:  # fmt: skip
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out += _commands(child, (*path, name))
    return out


def _long_flag(parser: argparse.ArgumentParser) -> str | None:
    for action in parser._actions:
        for option in action.option_strings:
            if (
                option.startswith("--")
                and len(option) > 6
                and option not in ("--help", "--version")
            ):
                return option
    return None


COMMANDS = [(p, f) for p, parser in _commands(_build_parser()) if (f := _long_flag(parser))]


def test_every_command_with_flags_is_checked() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"coordinator", "node", "router", "engine-sim", "bench fleet"} <= names


@pytest.mark.parametrize(("path", "flag"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_an_abbreviated_flag_is_refused(path: tuple[str, ...], flag: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        _build_parser().parse_args([*path, flag[:-1], "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err or "required" in err, err


def test_the_coordinators_own_parser_refuses_abbreviations_too() -> None:
    with pytest.raises((SystemExit, ValueError)):
        parse_config(["--chunk-siz", "256"])
