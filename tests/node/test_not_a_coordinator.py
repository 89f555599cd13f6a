"""A --coordinator-url that answers but is not a coordinator is exit 2 at start, saying what
was found there (issue 29 item 5): it used to be retried forever ("reply is not JSON")."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvatlas.asgi_thread import free_port

NODE = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--l2", "none",
        "--coordinator-event-reporting", "--log-level", "warning"]  # fmt: skip


class _Html(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b"<html><body>a web server</body></html>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def html_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_url_that_answers_html_is_exit_2_with_what_was_found() -> None:
    with html_server() as url:
        done = subprocess.run(
            [sys.executable, "-m", "kvatlas.cli", "node", *NODE, "--port", str(free_port()),
             "--coordinator-url", url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "<html><body>a web server" in done.stderr and "Traceback" not in done.stderr
