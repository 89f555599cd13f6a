"""Cache control kept in Redis (the Redis transport's replicas) against the in-memory tables:
the operations a route or a delivery pass calls, medians over repeats, on a throwaway local
``redis-server`` (or ``--redis-url``). docs/cache-control.md, "Replicas", quotes a run.

    python scripts/bench_cache_control_store.py [--pins 10000] [--keys 200000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

from kvatlas.asgi_thread import free_port
from kvatlas.coordinator.cache_control import PinTable
from kvatlas.coordinator.cache_control.shared_commands import SharedCommandLog
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.coordinator.cache_control.shared_tables import SharedPinTable
from kvatlas.keys import ObjectKey


def median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def keys(n: int) -> list[ObjectKey]:
    return [ObjectKey(os.urandom(32), "m", 16777472, 0, "s") for _ in range(n)]


def run(url: str, n_pins: int, n_keys: int) -> None:
    store = SharedStore.connect(url, f"kvatlas:bench-{os.getpid()}", "bench")
    shared, memory = SharedPinTable(store), PinTable()
    pins, many = keys(n_pins), keys(n_keys)
    rows = [
        (f"pin {n_pins:,} keys in one request", lambda t: t.pin(pins), 3),
        ("pin 8 keys", lambda t: t.pin(pins[:8]), 51),
        (f"a page of 1,000 of {n_pins:,} pins", lambda t: t.page(None, None, 0, 1000), 21),
        (f"pinned() of {n_keys:,} keys", lambda t: t.pinned(many), 5),
        ("pin one key, then read the pins", lambda t: (t.pin(pins[:1]), t.rows()), 5),
    ]
    print(f"{'operation':<40} {'redis ms':>10} {'memory ms':>10}")
    for name, op, repeats in rows:
        a = median_ms(lambda op=op: op(shared), repeats)
        b = median_ms(lambda op=op: op(memory), repeats)
        print(f"{name:<40} {a:>10.2f} {b:>10.2f}")
    log = SharedCommandLog(store)
    ids = [log.new("delete", ["n1"], [], tier="l1").command_id for _ in range(100)]
    log.unfinished()
    for name, call in (
        ("read 100 unfinished commands, unchanged", log.unfinished),
        ("renew the leases of 100 commands", lambda: log.claim(ids)),
        ("one compare-and-set change", lambda: log.due_now(ids[0])),
    ):
        print(f"{name:<40} {median_ms(call, 51):>10.2f} {'-':>10}")
    store.client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="default: a throwaway local redis-server")
    parser.add_argument("--pins", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=200_000)
    args = parser.parse_args()
    if args.redis_url:
        run(args.redis_url, args.pins, args.keys)
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found (scripts/ensure-redis.sh), or give --redis-url")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit("redis-server did not start") from None
                    time.sleep(0.05)
            run(f"redis://127.0.0.1:{port}/0", args.pins, args.keys)
        finally:
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main()
