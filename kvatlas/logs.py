"""Logs for the services: one format per process (JSON lines by default, ``text`` for humans),
uvicorn's and httpx's records included; and a throttle for warnings a remote party can trigger
at will.

uvicorn's own handlers are not installed (its records go through the root handler, so they
share the format); its access log is off unless asked for (``--access-log``). httpx logs
every request at INFO (a node's heartbeat every few seconds): those records are demoted to
DEBUG.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, Final

LOG_FORMATS: Final = ("json", "text")
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
_TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def _demote_to_debug(record: logging.LogRecord) -> bool:
    """httpx's per-request INFO line becomes DEBUG (kept only when the root logs DEBUG)."""
    if record.levelno == logging.INFO:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)
    return True


def configure_logging(level: str, log_format: str = "json") -> None:
    """The root handler in ``log_format`` (:data:`LOG_FORMATS`) at ``level``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    formatter = JsonLogFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    httpx_log = logging.getLogger("httpx")
    if _demote_to_debug not in httpx_log.filters:
        httpx_log.addFilter(_demote_to_debug)


def uvicorn_log_options(level: str, access_log: bool) -> dict[str, Any]:
    """uvicorn keyword arguments: no handlers of its own (the root's format), access log only
    when asked for."""
    return {"log_config": None, "log_level": level, "access_log": access_log}


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
