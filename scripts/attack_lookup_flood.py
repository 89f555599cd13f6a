"""Issue 25 item 8, measured: a salt-bound lookup token sends a 110 MiB body to
``/directory/lookup`` of a coordinator with default limits; prints the time to the reply, the
worst ``/healthz`` latency another client saw meanwhile and the server's peak RSS growth.

    PYTHONPATH=<checkout> python scripts/attack_lookup_flood.py [--chunked] [--mib 21]

Run it against two checkouts to compare (numbers in the report of the change, not in tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvatlas.coordinator.server import free_port
from kvatlas.processes import spawn_service, stop

TOKEN = "lookup-a-" + "x" * 32
MIB = 1 << 20


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def attack(port: int, total: int, chunked: bool) -> tuple[float, bytes, int]:
    head = b'{"model_name":"m","cache_salt":"a","token_ids":['
    piece = b"1," * (MIB // 2)
    lines = ["POST /directory/lookup HTTP/1.1", "Host: x", f"Authorization: Bearer {TOKEN}"]
    lines += ["Content-Type: application/json"]
    lines += ["Transfer-Encoding: chunked"] if chunked else [f"Content-Length: {total}"]
    started = time.perf_counter()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            tail = b"1]}"
            count, rest = divmod(total - len(head) - len(tail), len(piece))
            parts = [head] + [piece] * count + [b"1," * (rest // 2) + b" " * (rest % 2) + tail]
            for part in parts:
                conn.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                sent += len(part)
            if chunked:
                conn.sendall(b"0\r\n\r\n")
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n\r\n" not in reply:
                got = conn.recv(65536)
                if not got:
                    break
                reply += got
    return time.perf_counter() - started, reply.split(b"\r\n", 1)[0], sent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunked", action="store_true")
    parser.add_argument("--mib", type=int, default=110, help="body size (21: within the limit)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.json"
        entry = {"token": TOKEN, "role": "lookup", "cache_salts": ["a"]}
        tokens.write_text(json.dumps({"tokens": [entry]}))
        tokens.chmod(0o600)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--auth-token-file",
             str(tokens), "--log-level", "warning"], url,
        )  # fmt: skip
        try:
            worst, done = 0.0, threading.Event()

            def poll() -> None:
                nonlocal worst
                with httpx.Client(base_url=url, timeout=60) as c:
                    while not done.is_set():
                        t = time.perf_counter()
                        c.get("/healthz")
                        worst = max(worst, time.perf_counter() - t)
                        time.sleep(0.01)

            before = peak_rss(proc.pid)
            poller = threading.Thread(target=poll)
            poller.start()
            seconds, status, sent = attack(port, args.mib * MIB, args.chunked)
            time.sleep(0.5)
            done.set()
            poller.join()
            grown = peak_rss(proc.pid) - before
            print(
                f"reply {status.decode()!r} after {seconds:.2f} s, {sent / MIB:.0f} MiB sent; "
                f"worst /healthz {worst * 1e3:.0f} ms; peak RSS +{grown / MIB:.0f} MiB"
            )
        finally:
            stop([proc])


if __name__ == "__main__":
    main()
