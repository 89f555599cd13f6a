"""A counting stand-in for an MP server (LMCache's ``lmcache server`` or ``kvatlas node``) on a
real loopback port: it answers the routes the coordinator's delivery calls with their wire
shapes and counts every call, so a test can say how many times a command reached it. The port
is chosen first and listened on only from :meth:`FakeMpServer.start` (an instance that is
down, then comes back)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvatlas.asgi_thread import free_port


class FakeMpServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.delay_s = 0.0  # how long each answer takes (a slow node: deliveries overlap)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def count(self, method: str, path: str) -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.calls if (m, p) == (method, path))

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("content-length") or 0)
                parsed: dict[str, Any] = json.loads(self.rfile.read(n) or b"{}")
                return parsed

            def _record(self, body: dict[str, Any]) -> None:
                with owner._lock:
                    owner.calls.append((self.command, self.path, body))

            def do_DELETE(self) -> None:
                body = self._body()
                self._record(body)
                time.sleep(owner.delay_s)
                self._answer(200, {"deleted": len(body.get("keys", [])), "skipped": 0, "ok": True})

            def do_POST(self) -> None:
                body = self._body()
                self._record(body)
                self._answer(202, {"request_id": "f" * 32, "chunks": 1, "status": "submitted"})

            def do_GET(self) -> None:
                self._record({})
                self._answer(200, {"request_id": "f" * 32, "status": "completed",
                                   "found_keys": 0, "total_keys": 1})  # fmt: skip

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
