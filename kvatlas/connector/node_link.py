"""The connector's line to its node: one :class:`EngineClient`, opened lazily.

A KV cache that is down must never stop an engine from serving: a failed call is a miss
(nothing loaded, nothing stored), counted by cause and logged at most once a minute, and an
unreachable node is left alone for ``retry_s`` before the next attempt, so a scheduler step
does not wait on a dead node again and again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Final, TypeVar

import httpx

from kvatlas.client import EngineCallError, EngineClient, EngineLayout
from kvatlas.connector.settings import ConnectorSettings
from kvatlas.errors import Unavailable
from kvatlas.logs import Throttle

log = logging.getLogger(__name__)
T = TypeVar("T")
_WARN_EVERY_S = 60.0
LAYOUT_CHECK_S: Final = 1.0
"""How long the node's layout, read again, is taken as unchanged (:meth:`NodeLink.same_layout`)."""


class NodeLink:
    def __init__(self, settings: ConnectorSettings, timeout_s: float | None = None) -> None:
        self.settings = settings
        self.timeout_s = settings.timeout_s if timeout_s is None else timeout_s
        self.failures: Counter[str] = Counter()
        self._client: EngineClient | None = None
        self._down_until = 0.0
        self._layout_good_until = -math.inf  # same_layout's last confirmation holds until
        self._say = Throttle(_WARN_EVERY_S)  # a failure, each other layout: once a minute

    def client(self) -> EngineClient:
        """The client (reads the node's layout on first contact); raises when unreachable."""
        if self._client is None:
            self._client = EngineClient(
                self.settings.node_url, timeout=self.timeout_s, token=self.settings.token
            )
        return self._client

    def layout(self) -> EngineLayout:
        """The node's layout, read at start-up; a node that does not give it is refused naming
        its URL (a bare ``ConnectError`` would not say which connector or node)."""
        try:
            layout = self.client().layout
        except (httpx.HTTPError, EngineCallError) as exc:
            raise Unavailable(
                f"kvatlas connector: no layout from the node at {self.settings.node_url} "
                f"(GET /engine/layout: {type(exc).__name__}: {exc}); the node must be up when "
                "the engine starts (kv_connector_extra_config.node_url)"
            ) from None
        assert isinstance(layout, EngineLayout)
        return layout

    def same_layout(self, layout: EngineLayout) -> bool:
        """Whether the node still has ``layout``, read again: a node restarted with another
        chunk size, model or dtype would answer every call, in its new layout, and the bytes
        read in the old one would be wrong KV. A node that does not answer is not the same.
        A confirmation holds :data:`LAYOUT_CHECK_S`, or until a call fails (a node's restart
        takes longer, and its calls fail in between), so a busy engine reads it once a second,
        not once a step. Another layout is counted at every read and logged once a minute
        (each layout)."""
        now = time.monotonic()
        if now < self._layout_good_until:
            return True
        got: EngineLayout | None = self.call("layout", lambda c: c.node_layout(), None)
        if got == layout:
            self._layout_good_until = now + LAYOUT_CHECK_S
        if got is not None and got != layout:
            self.failures["layout_changed"] += 1
            if self._say(f"layout {got!r}"):
                log.error(
                    "kvatlas node %s: its layout is now %s, not %s as when the engine started; "
                    "nothing is loaded from it or stored to it (restart the engine)",
                    self.settings.node_url, got, layout,
                )  # fmt: skip
        return got == layout

    def call(self, what: str, fn: Callable[[EngineClient], T], fallback: T) -> T:
        """``fn(client)``, or ``fallback`` when the node fails (counted as ``what``)."""
        if time.monotonic() < self._down_until:
            self.failures[f"{what}_skipped_node_down"] += 1
            return fallback
        try:
            return fn(self.client())
        except (httpx.HTTPError, EngineCallError) as exc:
            self._layout_good_until = -math.inf  # a node restarting? its layout is read again
            unreachable = isinstance(exc, httpx.TransportError)
            if unreachable:
                self._down_until = time.monotonic() + self.settings.retry_s
            self.failures[what] += 1
            if self._say("failure"):
                log.warning(
                    "kvatlas node %s: %s failed (%s); treated as a miss%s (failures so far: %s)",
                    self.settings.node_url, what, exc,
                    f", node left alone for {self.settings.retry_s:g} s" if unreachable else "",
                    dict(self.failures),
                )  # fmt: skip
            return fallback

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
