"""Dataclass configs as command-line flags, each also settable as ``KVATLAS_<NAME>``.

Precedence: command line > environment > default. Values are converted by the field's declared
type (``bool``, ``int``, ``float``, ``str``, ``Path``; ``X | None`` maps an empty value to None),
so every service parses its flags and its environment the same way.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class FlagParser(argparse.ArgumentParser):
    """Every command's parser: an abbreviated flag is an error (``--num-kv-head`` must not
    quietly mean ``--num-kv-heads``, nor change meaning when a longer flag is added).
    Subcommands' parsers are of this class too (argparse makes them of their parent's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def env_name(field: str) -> str:
    return "KVATLAS_" + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """``(T, optional)`` for ``T`` or ``T | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    help_texts: Mapping[str, str],
    choices: Mapping[str, Sequence[str]] | None = None,
    repeatable: Sequence[str] = (),
) -> None:
    """One flag per field; a field in ``choices`` shows them as ``{a,b}`` and refuses others;
    a ``str`` field in ``repeatable`` may be given several times (joined with commas)."""
    hints = typing.get_type_hints(cls)
    choices = choices or {}
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        help_text = (
            f"{help_texts.get(f.name, '')} [env {env_name(f.name)}; default {default}]".strip()
        )
        if _base_type(hints[f.name])[0] is bool:
            parser.add_argument(
                flag_name(f.name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif f.name in repeatable:
            parser.add_argument(
                flag_name(f.name), action="append", default=None, metavar=f.name.upper(),
                help=help_text,
            )  # fmt: skip
        elif f.name in choices:
            parser.add_argument(
                flag_name(f.name), default=None, choices=choices[f.name], help=help_text
            )
        else:
            parser.add_argument(
                flag_name(f.name), default=None, metavar=f.name.upper(), help=help_text
            )


def _convert(raw: object, annotation: Any) -> object:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, list):  # a repeatable flag given several times
        raw = ",".join(str(item) for item in raw)
    base, optional = _base_type(annotation)
    text = str(raw)
    if optional and text == "":
        return None
    if base is bool:
        return parse_bool(text)
    if base is int:
        return int(text)
    if base is float:
        return float(text)
    if base is Path:
        return Path(text)
    return text


def dataclass_from_args(
    cls: type[T], args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> T:
    """Merge parsed flags over ``KVATLAS_*`` variables over defaults; ``ValueError`` names the flag."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        raw = getattr(args, f.name, None)
        if raw is None and env_name(f.name) in env:
            raw = env[env_name(f.name)]
        if raw is None:
            continue
        try:
            values[f.name] = _convert(raw, hints[f.name])
        except ValueError as exc:
            raise ValueError(f"{flag_name(f.name)}: {exc}") from None
    return cls(**values)
