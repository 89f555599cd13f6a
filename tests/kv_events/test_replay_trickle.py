"""A replay endpoint that trickles replies and engines that then go away: the coordinator
neither stalls the other engines past the replay's deadline nor dies (real coordinator
process, real ZMQ sockets on loopback; found by a black-box probe)."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from kvatlas.bench.kv_events_stall import maximal_message
from kvatlas.coordinator.server import free_port
from kvatlas.events.vllm_wire import pack_seq
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for

CHUNK = 32


def stored(j: int) -> bytes:
    """A vLLM batch storing one chunk (two 16-token blocks), distinct per ``j``."""
    event = {
        "type": "BlockStored",
        "block_hashes": [(100 + 2 * j).to_bytes(32, "big"), (101 + 2 * j).to_bytes(32, "big")],
        "parent_block_hash": None,
        "token_ids": list(range(1000 + CHUNK * j, 1000 + CHUNK * (j + 1))),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([time.time(), [event], None])


def last_seq(url: str, engine: str) -> int | None:
    rows = HTTP.get(f"{url}/instances").json()["instances"]
    return next((r["last_seq"] for r in rows if r["instance_id"] == engine), None)


def disconnects(url: str) -> int:
    return int(HTTP.get(f"{url}/healthz").json()["kv_events"]["subscriber"]["disconnects"])


def test_a_trickling_replay_stalls_other_engines_at_most_its_deadline_and_nothing_dies() -> None:
    """``eng-r`` jumps its seq (a gap: replay asked) and its replay socket answers one batch
    a second, never the end marker; ``eng-s`` publishes live meanwhile. ``eng-s``'s batches
    were applied only when the trickle stopped (never, for a large gap); now after the
    replay's deadline. Then every publisher goes: the subscriber used to ``disconnect`` and
    ``connect`` its SUB sockets with ``eng-s``'s batches still queued, and libzmq aborted the
    process (``Assertion failed: !_more (src/fq.cpp:80)``)."""
    port, pr, ps, rr = free_port(), free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    ctx: zmq.Context[Any] = zmq.Context()
    pub_r, pub_s, router = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock, at in ((pub_r, pr), (pub_s, ps), (router, rr)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{at}")
    proc = spawn_service(
        ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(CHUNK),
         "--kv-events-subscribe", f"eng-r=tcp://127.0.0.1:{pr},eng-s=tcp://127.0.0.1:{ps}",
         "--kv-events-replay", f"tcp://127.0.0.1:{rr},", "--kv-events-model", "llama"],
        url,
    )  # fmt: skip
    done = threading.Event()

    def trickle() -> None:
        if not router.poll(30_000):
            return
        ident, *_, start = router.recv_multipart()
        seq = int.from_bytes(start, "big", signed=True)
        while not done.wait(1.0):
            router.send_multipart([ident, b"", b"kv@eng-r@llama", pack_seq(seq), stored(seq)])
            seq += 1

    big = maximal_message(np.random.default_rng(1), 10_000)
    dripper = threading.Thread(target=trickle, daemon=True)
    dripper.start()
    try:
        assert wait_for(
            lambda: (
                pub_r.send_multipart([b"kv@eng-r@llama", pack_seq(0), stored(0)]) is None
                and pub_s.send_multipart([b"kv@eng-s@llama", pack_seq(0), stored(500)]) is None
                and last_seq(url, "eng-r") is not None
                and last_seq(url, "eng-s") is not None
            ),
            timeout=30,
            interval=0.2,
        )  # (a PUB drops what it sends before the subscription arrives: sent until seen)
        applied = last_seq(url, "eng-s")  # (the gate's seq of its batches, not the ZMQ one)
        assert applied is not None
        pub_r.send_multipart([b"kv@eng-r@llama", pack_seq(10**9), stored(5)])
        time.sleep(0.5)
        for seq in (1, 2):
            pub_s.send_multipart([b"kv@eng-s@llama", pack_seq(seq), stored(500 + seq)])
        assert wait_for(lambda: last_seq(url, "eng-s") == applied + 2, timeout=40, interval=0.5)
        # eng-r keeps the subscriber busy while eng-s queues batches and goes away
        pub_r.send_multipart([b"kv@eng-r@llama", pack_seq(10**9 + 1), big])
        for seq in range(3, 9):
            pub_s.send_multipart([b"kv@eng-s@llama", pack_seq(seq), stored(500 + seq)])
        done.set()
        dripper.join()
        for sock in (router, pub_r, pub_s):
            sock.close(0)
        # every publisher's leaving seen and handled (the old code aborted here)
        assert wait_for(lambda: proc.poll() is not None or disconnects(url) >= 2, timeout=60)
        assert proc.poll() is None, "the coordinator died"
        # eng-s's batches queued on its old socket were applied, not dropped with it
        assert wait_for(lambda: last_seq(url, "eng-s") == applied + 8, timeout=60, interval=0.5)
    finally:
        done.set()
        for sock in (router, pub_r, pub_s):
            sock.close(0)
        ctx.term()
        stop([proc])
