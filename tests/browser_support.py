"""Headless Chromium for tests, driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: JSON messages ending in NUL on fds 3 and 4), so no browser
download, no websocket client and no port are needed.

Chromium is Debian's ``chromium`` package, installed by ``make test``
(``scripts/ensure-chromium.sh``). Without it a test fails under ``CI`` and skips locally
(the same rule as ``tests/torch_support.py``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.torch_support import ci_enabled

WIDTH, HEIGHT = 1280, 800


def require_chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is not None:
        return path
    if ci_enabled():
        pytest.fail("chromium is required under CI but is not installed; see `make test`")
    pytest.skip("chromium not installed: browser test skipped; `make test` installs it")


class Browser:
    """One headless Chromium with one page; every console message, uncaught exception and
    log entry of the page is kept in :attr:`problems` (level error or warning) and
    :attr:`console` (everything the page logged)."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        self._proc = subprocess.Popen(
            [
                binary, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "about:blank",
            ],
            pass_fds=(3, 4),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: (os.dup2(to_chrome_r, 3), os.dup2(from_chrome_w, 4)),
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self._session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)[
            "sessionId"
        ]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip

    def _read(self) -> None:
        buffer = b""
        while True:
            data = os.read(self._from_chrome, 1 << 16)
            if not data:
                return
            buffer += data
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                with self._lock:
                    waiter = self._replies.pop(message.get("id", -1), None)
                    if waiter is None:
                        self.events.append(message)
                if waiter is not None:
                    waiter.put(message)

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            waiter: queue.Queue[dict[str, Any]] = queue.Queue()
            self._replies[ident] = waiter
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        reply = waiter.get(timeout=60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """A command to the page's session."""
        return self.send(method, self._session, **params)

    def navigate(self, url: str, timeout: float = 30.0) -> None:
        before = len(self.events)
        self.call("Page.navigate", url=url)
        self.wait_for(lambda: any(
            e.get("method") == "Page.loadEventFired" for e in self.events[before:]
        ), timeout)  # fmt: skip

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("browser: condition not met before the deadline")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    @property
    def console(self) -> list[str]:
        out = []
        for e in list(self.events):
            if e.get("method") == "Runtime.consoleAPICalled":
                p = e["params"]
                out.append(f"{p['type']}: " + " ".join(str(a.get("value")) for a in p["args"]))
        return out

    @property
    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, failed loads, CSP violations."""
        out = []
        for e in list(self.events):
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails']}")
            elif method == "Runtime.consoleAPICalled" and p["type"] in (
                "error",
                "warning",
                "assert",
            ):
                out.append(f"console.{p['type']}: {p['args']}")
            elif method == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(
                    f"log {p['entry']['level']}: {p['entry']['text']} {p['entry'].get('url', '')}"
                )
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, queue.Empty):
            self.send("Browser.close")
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_chrome)
        self._reader.join(timeout=5)
        os.close(self._from_chrome)
