"""Event errors that name the offending field, so a 422 reply can say exactly what was wrong.

Both are :class:`kvatlas.errors.Unprocessable` (and so still ``ValueError``): the reply built
from one carries ``detail`` and the ``field`` path (see :mod:`kvatlas.errors`).
"""

from __future__ import annotations

import re

import msgspec

from kvatlas.errors import Unprocessable


class EventValidationError(Unprocessable):
    """An event (batch or entry) breaks a field rule; ``field`` is a dotted/indexed path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message, field=field)
        self.field = field
        self.reason = message

    def under(self, prefix: str) -> EventValidationError:
        """The same error, re-rooted below ``prefix`` (e.g. ``batches[2]``)."""
        field = f"{prefix}.{self.field}" if self.field and prefix else (prefix or self.field)
        return type(self)(field, self.reason)


class EventDecodeError(EventValidationError):
    """A wire body (JSON or msgpack) could not be decoded into valid batches; nothing leaks out."""


_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_NAMED = re.compile(r"(?:missing required|unknown) field `(?P<name>[^`]*)`")


def decode_error_from_msgspec(exc: msgspec.MsgspecError) -> EventDecodeError:
    """Turn msgspec's ``... - at `$.a[0].b``` message into an error whose ``field`` is ``a[0].b``."""
    text = str(exc)
    match = _PATH.match(text)
    message, path = (match.group("msg"), match.group("path") or "") if match else (text, "")
    named = _NAMED.search(message)
    if named:
        path = f"{path}.{named.group('name')}"
    return EventDecodeError(path.lstrip(".") or "body", message)
