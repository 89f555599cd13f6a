"""The soak's change watch (``kvatlas/soak/watch.py``) against a replica stand-in over real
HTTP on loopback: it dates a directory's last change, ignores fields a change does not move,
and counts a replica that stopped answering as a change."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvatlas.soak.watch import ChangeWatch


class _Replica:
    def __init__(self) -> None:
        self.stats: dict[str, Any] = {"keys": 1, "placements": 1, "batches": {"applied": 1}}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(outer.stats).encode()
                self.send_response(200 if self.path == "/directory/stats" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def replicas() -> Iterator[tuple[_Replica, _Replica]]:
    a, b = _Replica(), _Replica()
    yield a, b
    for r in (a, b):
        r.server.shutdown()
        r.server.server_close()


def test_the_watch_dates_the_last_change_of_any_replica(
    replicas: tuple[_Replica, _Replica],
) -> None:
    a, b = replicas
    watch = ChangeWatch({"a": a.url, "b": b.url})
    watch.start()
    try:
        first = watch.settled_at()
        assert first is not None
        a.stats = {**a.stats, "hash_scheme": "other", "instances_alive": 9}  # not a change
        assert watch.settled_at() == first
        before = time.monotonic()
        b.stats = {**b.stats, "batches": {"applied": 2}}  # a placement replaced: same counts
        settled = watch.settled_at()
        assert settled is not None and before <= settled and settled > first
        assert watch.settled_at() == settled  # nothing changed since
        gone = time.monotonic()  # (a round under way may see it stop before shutdown returns)
        a.server.shutdown()  # a replica that stops answering has changed
        a.server.server_close()
        later = watch.settled_at()
        assert later is not None and later >= gone
    finally:
        watch.stop()
    assert watch.settled_at(timeout=0.2) is None  # a stopped watch takes no more rounds
