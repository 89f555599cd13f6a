"""Dataclass configs as command-line flags, each also settable as ``KVATLAS_<NAME>``.

Precedence: command line > environment > default. Values are converted by the field's declared
type (``bool``, ``int``, ``float``: a finite one, ``str``, ``Path``; ``X | None`` maps an empty
value to None; an empty value is not set, but a ``bool``'s: false), and a field with choices
holds one of them (:func:`check_choices`), so every service parses its flags and its
environment the same way.

One name per setting: the field's name is its flag (``--a-b``), its variable (``KVATLAS_A_B``)
and, where a reply reports it, its HTTP field (docs/configuration.md has the table). A renamed
field keeps its old flag and variable for one release (``renamed``): they still work, and each
use warns (a logged warning and a :class:`DeprecationWarning`) naming the new spelling.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import types
import typing
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

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


def warn_renamed(old: str, new: str) -> None:
    """Say that ``old`` (a flag or variable) is the previous spelling of ``new``."""
    message = f"{old} is deprecated and goes in the next release: use {new}"
    log.warning("%s", message)
    warnings.warn(message, DeprecationWarning, stacklevel=3)


class _RenamedFlag(argparse.Action):
    """An old spelling: stores into the new field's destination, warning on each use."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kw: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        negated = bool(option_string and option_string.startswith("--no-"))
        new = ("--no-" + self.new[2:]) if negated else self.new
        warn_renamed(option_string or self.new, new)
        setattr(namespace, self.dest, (not negated) if self.nargs == 0 else values)


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
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    help_texts: Mapping[str, str],
    choices: Mapping[str, Sequence[str]] | None = None,
    repeatable: Sequence[str] = (),
    renamed: Mapping[str, str] | None = None,
    only: Collection[str] | None = None,
) -> None:
    """One flag per field; a field in ``choices`` shows them as ``{a,b}`` and refuses others;
    a ``str`` field in ``repeatable`` may be given several times (joined with commas);
    ``renamed`` maps old field names to new ones (hidden flags that warn, see module doc);
    ``only``: the fields to offer (default every one; another command borrowing some of a
    service's flags, with their help, keeps their names)."""
    hints = typing.get_type_hints(cls)
    choices = choices or {}
    for old, new in (renamed or {}).items():
        if only is not None and new not in only:
            continue
        is_bool = _base_type(hints[new])[0] is bool
        options = [flag_name(old)] + (["--no-" + old.replace("_", "-")] if is_bool else [])
        parser.add_argument(
            *options, dest=new, action=_RenamedFlag, new=flag_name(new), nargs=0 if is_bool else None,
            default=None, choices=None if is_bool else choices.get(new), help=argparse.SUPPRESS,
        )  # fmt: skip
    for f in fields(cls):
        if only is not None and f.name not in only:
            continue
        default = "" if f.default is MISSING else f"; default {f.default}"  # computed: see help
        help_text = f"{help_texts.get(f.name, '')} [env {env_name(f.name)}{default}]".strip()
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
    if base is float:  # NaN and infinity are no setting's value (a NaN passes `< 0` checks)
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {text!r}")
        return value
    if base is Path:
        return Path(text)
    return text


def check_choices(config: object, choices: Mapping[str, Sequence[str]]) -> None:
    """A config's ``__post_init__``: each field of ``choices`` holds one of them. argparse
    checks a flag's value only: a variable's (``KVATLAS_LOG_LEVEL=bogus``) crashed later."""
    for name, allowed in choices.items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(
                f"{flag_name(name)}: invalid choice: {value!r} (choose from {', '.join(allowed)})"
            )


def dataclass_from_args(
    cls: type[T],
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    renamed: Mapping[str, str] | None = None,
    only: Collection[str] | None = None,
) -> T:
    """Merge parsed flags over ``KVATLAS_*`` variables over defaults; ``ValueError`` names the
    flag. A variable of a ``renamed`` field's old name counts (with a warning) when the new one
    is not set. ``only``: the fields read (the others keep their defaults)."""
    env = os.environ if environ is None else environ
    for old, new in (renamed or {}).items():
        if env_name(old) in env and env_name(new) not in env:
            warn_renamed(env_name(old), env_name(new))
            env = {**env, env_name(new): env[env_name(old)]}
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if only is not None and f.name not in only:
            continue
        raw = getattr(args, f.name, None)
        if raw is None and env_name(f.name) in env:
            raw = env[env_name(f.name)]
        if raw is None or (raw == "" and _base_type(hints[f.name])[0] is not bool):
            continue  # not set: an empty value is too (`--event-stream ''` was a stream "")
        try:
            values[f.name] = _convert(raw, hints[f.name])
        except ValueError as exc:
            raise ValueError(f"{flag_name(f.name)}: {exc}") from None
    return cls(**values)
