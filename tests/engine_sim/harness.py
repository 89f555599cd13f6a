"""A real ``kvatlas engine-sim`` process on loopback, and what its clients need: HTTP calls,
SSE splitting, a replay client for its KV events."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import zmq

from kvatlas.asgi_thread import free_port
from kvatlas.events.vllm_wire import unpack_seq
from kvatlas.processes import spawn_service, stop

MODEL = "sim"
INSTANCE = "pod-a"
TOPIC = f"kv@{INSTANCE}@{MODEL}"


class EngineProcess:
    def __init__(self, *flags: str) -> None:
        port, self.pub_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] = spawn_service(
            ["-m", "kvatlas.cli", "engine-sim", "--port", str(port), "--model", MODEL,
             "--instance-id", INSTANCE, "--speed", "1000", "--log-format", "text",
             "--kv-events-endpoint", f"tcp://*:{self.pub_port}",
             "--kv-events-replay-endpoint", f"tcp://*:{self.replay_port}", *flags],
            self.url,
        )  # fmt: skip
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def post(self, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
        if isinstance(body, bytes):
            return self.http.post(path, content=body, headers={"content-type": "application/json"})
        return self.http.post(path, json=body)

    def complete(
        self, prompt: str | list[int], max_tokens: int = 2, **extra: Any
    ) -> dict[str, Any]:
        reply = self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        return body

    def healthz(self) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get("/healthz").json()
        return body

    def replay(self, start: int = 0) -> list[tuple[bytes, int, bytes]]:
        """Every kept batch from ``start`` through vLLM's replay protocol (a DEALER)."""
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if unpack_seq(seq) == -1:
                    assert topic == b"" and payload == b""  # vLLM's end marker
                    return out
                out.append((topic, unpack_seq(seq), payload))
        finally:
            dealer.close(0)

    def close(self) -> None:
        self.http.close()
        stop([self.proc])


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, refusing anything but ``data: X\\n\\n`` frames."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-60:]
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame[:80]
        out.append(frame[len(b"data: ") :])
    assert out[-1] == b"[DONE]" and b"[DONE]" not in out[:-1]
    return out[:-1]


def compact(value: Any) -> bytes:
    """What vLLM's ``JSONResponse`` writes for a dumped model."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
