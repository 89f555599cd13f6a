"""Structured logs for the services: one JSON object per line, parseable without regexes; and
a throttle for warnings a remote party can trigger at will."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class Throttle:
    """Allows one event per ``key`` every ``interval`` seconds (a warning per peer per minute,
    say): a misbehaving source must not be able to flood the log. Thread-safe enough: two
    racing callers may both pass once. At most ``max_keys`` keys are remembered; past that
    the memory is cleared (a flood of fresh keys gets one line each, not unbounded state)."""

    def __init__(
        self,
        interval: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[str, float] = {}

    def __call__(self, key: str) -> bool:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            return False
        if len(self._last) >= self._max_keys:
            self._last.clear()
        self._last[key] = now
        return True
