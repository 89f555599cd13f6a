"""Issue 16 item 5: with auth on, a request is authenticated (and its route's role checked)
from its headers before a byte of its body is read, on every body route including the blend
fast path; large bodies are parsed off the event loop; the default body limit is the largest
legitimate request, derived from the other limits. Against a real coordinator process."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.coordinator import service as service_module
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.routes import directory as directory_routes
from kvatlas.coordinator.server import free_port
from kvatlas.processes import stop
from tests.coordinator.helpers import CS, Emitter, fresh, fresh_tokens, running
from tests.coordinator.security_support import (
    ADMIN,
    EMIT_ANY,
    LOOKUP_ALL,
    bearer,
    peak_rss_bytes,
    raw_request,
    reset_peak_rss,
    spawn_coordinator,
    status_of,
    write_tokens,
)

BODY_ROUTES = ("/events", "/directory/lookup", "/directory/blend-lookup", "/instances")
DECLARED = 20_000_000  # under the old 256 MiB limit and the new default: only auth can refuse


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("auth-first") / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": EMIT_ANY, "role": "emit"},
        {"token": LOOKUP_ALL, "role": "lookup"},
    )
    port = free_port()
    proc = spawn_coordinator(
        port, "--auth-token-file", str(tokens), "--chunk-size", "16", "--enable-blend-lookup"
    )
    yield port, proc.pid
    stop([proc])


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize("headers", [{}, bearer("unknown-token-" + "u" * 32)])
def test_unauthenticated_body_is_refused_without_reading_it(
    coordinator: tuple[int, int], path: str, headers: dict[str, str]
) -> None:
    """The client announces 20 MB and sends 2 bytes: the 401 comes back at once (a server
    that reads the body first would wait for the other 19.99 MB until the socket times
    out)."""
    port, _ = coordinator
    reply = raw_request(port, "POST", path, declared=DECLARED, body=b"{}", headers=headers)
    assert status_of(reply) == 401, reply[:300]
    assert b"www-authenticate: Bearer" in reply.lower().replace(b"bearer", b"Bearer")


@pytest.mark.parametrize(
    ("path", "who"),
    [
        ("/events", LOOKUP_ALL),
        ("/directory/lookup", EMIT_ANY),
        ("/directory/blend-lookup", EMIT_ANY),
        ("/instances", LOOKUP_ALL),
    ],
)
def test_wrong_role_is_refused_without_reading_the_body(
    coordinator: tuple[int, int], path: str, who: str
) -> None:
    port, _ = coordinator
    reply = raw_request(port, "POST", path, declared=DECLARED, body=b"{}", headers=bearer(who))
    assert status_of(reply) == 403, reply[:300]


def test_unauthenticated_large_bodies_do_not_grow_server_memory(
    coordinator: tuple[int, int],
) -> None:
    """Three 25 MB lookups without a token: a server that parses them before checking the
    token peaks hundreds of MB higher (a list of millions of ints); ours never reads them."""
    port, pid = coordinator
    ids = b",".join([b"4000000000"] * 2_270_000)
    body = b'{"model_name":"m","token_ids":[' + ids + b"]}"
    assert len(body) < 30_000_000  # under the default limit at --chunk-size 16 (31 MB)
    before = reset_peak_rss(pid)  # the earlier tests' peaks are not this one's
    for _ in range(3):
        raw_request(port, "POST", "/directory/lookup", declared=len(body), body=body)
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
    grown = peak_rss_bytes(pid) - before
    assert grown < 40 * 1024 * 1024, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_default_body_limit_is_the_largest_legitimate_request() -> None:
    from kvatlas.coordinator.body_limits import largest_request_bytes

    config = CoordinatorConfig()
    assert config.max_body_bytes is None
    assert config.body_limit == largest_request_bytes(
        config.max_query_tokens, config.max_batch_entries, config.chunk_size
    )
    assert config.body_limit < 256 * 1024 * 1024  # the old fixed default
    assert CoordinatorConfig(max_body_bytes=1234).body_limit == 1234


def test_largest_legitimate_requests_fit_the_derived_limit() -> None:
    """A full-context blend lookup (base64) and a full batch of token-bearing entries whose
    token ids and names are as long as the formula assumes are accepted; one more token or
    entry is refused by the limit it breaks (413 naming it), not by the body size."""
    max_tokens, max_entries = 4096, 64
    with running(
        enable_blend_lookup=True, max_query_tokens=max_tokens, max_batch_entries=max_entries
    ) as (server, c):
        limit = server.config.body_limit
        model = "m" * 256
        tokens = np.full(max_tokens, 4_000_000_000, dtype="<u4")
        blend = {"tokens_b64": base64.b64encode(tokens.tobytes()).decode(), "model_name": model}
        r = c.post("/directory/blend-lookup", json=blend)
        assert r.status_code == 200, r.text
        em = Emitter(fresh("big"))
        tokens_all = [4_000_000_000 + i for i in range(max_entries * CS)]
        batch = em.store_chunks(tokens_all, model=model, salt="s" * 128)
        body = httpx.Request("POST", "/", json={"batches": [batch]}).content
        assert len(body) <= limit, (len(body), limit)
        r = c.post("/events", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["applied"] == 1
        tokens_plus = fresh_tokens(max_entries + 1)
        r = c.post("/events", json={"batches": [Emitter().store_chunks(tokens_plus)]})
        assert r.status_code == 413 and "max-batch-entries" in r.json()["detail"]


def test_lookup_body_is_parsed_like_before(tmp_path: Path) -> None:
    """The lookup body is parsed by the route on a worker thread: bad JSON and bad fields
    are still a 422 naming the field."""
    with running() as (_, c):
        r = c.post(
            "/directory/lookup", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 422 and r.json()["detail"]
        r = c.post("/directory/lookup", json={"token_ids": "abc", "model_name": "m"})
        assert r.status_code == 422 and r.json()["detail"].startswith("token_ids")


def test_lookup_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a lookup body is being parsed, /healthz answers: the parse holds until it has
    (a parse on the event loop would block /healthz, and the parse would give up after
    30 s with a failed request). Only a body of at most ``INLINE_BODY_BYTES`` (16 KiB: work
    bounded by its size) is answered on the loop; this one is larger."""
    parsing, answered = threading.Event(), threading.Event()
    real = directory_routes.decode_lookup_body

    def held(raw: bytes, *limits: int) -> Any:
        parsing.set()
        if not answered.wait(30):
            raise AssertionError("/healthz did not answer while a lookup body was parsed")
        return real(raw, *limits)

    monkeypatch.setattr(directory_routes, "decode_lookup_body", held)
    with (
        running() as (server, c),
        httpx.Client(base_url=server.url, timeout=30) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        body = {"token_ids": fresh_tokens(2_000), "model_name": "m"}
        assert len(json.dumps(body)) > service_module.INLINE_BODY_BYTES
        reply = pool.submit(c.post, "/directory/lookup", json=body)
        assert parsing.wait(30)
        assert other.get("/healthz").status_code == 200
        answered.set()
        assert reply.result().status_code == 200
