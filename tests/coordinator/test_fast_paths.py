"""The one request stack (``kvatlas.dispatch``): a route is one entry in the table and one
handler, and gets, without writing any of it, what every route gets — the token checked from
the headers before a byte of the body is read, the body limits, errors rendered by
``kvatlas.web``. And a blend lookup too long to be answered on the event loop is matched on the
pool while the loop goes on, and a small events body is applied on the loop only while the
directory is free. Real HTTP on loopback."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.coordinator import blend_lookup, events_ingest
from kvatlas.coordinator import service as service_module
from kvatlas.coordinator.app import TABLE, create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.errors import Unprocessable
from kvatlas.events import UNKNOWN_OFFSET, CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.routing import Access, Call, Reply, Route, RouteTable
from tests.coordinator.helpers import assert_error, running
from tests.coordinator.security_support import bearer, raw_request, status_of, write_tokens

TOKEN = "fast-path-test-token-" + "t" * 24
LIMIT = 4096


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[Any]]]:
    """A coordinator with one more route, ``POST /test/echo``: one table entry."""
    tokens = write_tokens(
        tmp_path_factory.mktemp("fast") / "tokens.json", {"token": TOKEN, "role": "lookup"}
    )
    config = CoordinatorConfig(auth_token_file=tokens, max_body_bytes=LIMIT)
    calls: list[Any] = []

    async def echo(_ctx: object, call: Call[None, None]) -> Reply:
        calls.append((call.raw, call.who.name))
        if call.raw == b"bad":
            raise Unprocessable("bad body")
        return Reply(b'{"length":%d}' % len(call.raw), 201, ((b"x-test", b"yes"),))

    route = Route("POST", "/test/echo", Access(("lookup",)), echo, request=bytes)
    app = create_app(CoordinatorService(config), RouteTable((*TABLE.routes, route)))
    server = ThreadedServer(app, port=free_port())
    server.start()
    yield server.port, calls
    server.stop()


def test_a_fast_route_answers_with_its_reply(echo: tuple[int, list[Any]]) -> None:
    port, calls = echo
    r = httpx.post(f"http://127.0.0.1:{port}/test/echo", content=b"abc", headers=bearer(TOKEN))
    assert (r.status_code, r.content, r.headers["x-test"]) == (201, b'{"length":3}', "yes")
    assert r.headers["content-type"] == "application/json"
    assert calls[-1][0] == b"abc"


def test_a_fast_route_error_is_rendered_like_any_other(echo: tuple[int, list[Any]]) -> None:
    port, _ = echo
    r = httpx.post(f"http://127.0.0.1:{port}/test/echo", content=b"bad", headers=bearer(TOKEN))
    assert assert_error(r, 422) == {"detail": "bad body"}


def test_a_fast_route_refuses_before_reading_the_body(echo: tuple[int, list[Any]]) -> None:
    """20 MB announced, 2 bytes sent: the 401 comes at once and the route is never called."""
    port, calls = echo
    before = len(calls)
    reply = raw_request(port, "POST", "/test/echo", declared=20_000_000, body=b"{}")
    assert status_of(reply) == 401, reply[:300]
    assert b"www-authenticate: bearer" in reply.lower()
    assert len(calls) == before


def test_a_fast_route_has_the_body_limit(echo: tuple[int, list[Any]]) -> None:
    port, calls = echo
    before = len(calls)
    url = f"http://127.0.0.1:{port}/test/echo"
    r = httpx.post(url, content=b"x" * (LIMIT + 1), headers=bearer(TOKEN))
    assert assert_error(r, 413)["detail"] == f"body of {LIMIT + 1} bytes exceeds {LIMIT}"
    pieces = iter([b"x" * 1000] * 5)  # no Content-Length: counted while streaming
    r = httpx.post(url, content=pieces, headers=bearer(TOKEN))
    assert assert_error(r, 413)["detail"] == f"body exceeds {LIMIT} bytes"
    assert len(calls) == before
    r = httpx.post(url, content=iter([b"x" * 1000] * 4), headers=bearer(TOKEN))
    assert r.status_code == 201 and r.json() == {"length": 4000}


def test_a_long_blend_query_is_matched_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A body over ``INLINE_BODY_BYTES`` is answered on the match pool: while it is being
    answered, /healthz answers (on the loop it would wait, and the answer would give up)."""
    answering, answered = threading.Event(), threading.Event()
    real = blend_lookup.BlendLookup.answer

    def held(self: blend_lookup.BlendLookup, raw: bytes, *args: Any) -> tuple[bytes, bool]:
        if len(raw) > 1000:  # the long query, not the short one below
            answering.set()
            if not answered.wait(30):
                raise AssertionError("/healthz did not answer while a long query was matched")
        return real(self, raw, *args)

    monkeypatch.setattr(blend_lookup.BlendLookup, "answer", held)
    tokens = np.arange(blend_lookup.INLINE_BODY_BYTES // 4, dtype="<u4")  # ≈350 KB of base64
    body = {"tokens_b64": base64.b64encode(tokens.tobytes()).decode(), "model_name": "m"}
    with (
        running(enable_blend_lookup=True) as (server, c),
        httpx.Client(base_url=server.url, timeout=30) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        reply = pool.submit(c.post, "/directory/blend-lookup", json=body)
        assert answering.wait(30)
        assert other.get("/healthz").status_code == 200
        answered.set()
        assert reply.result().status_code == 200
        short = c.post("/directory/blend-lookup", json={"token_ids": [1, 2], "model_name": "m"})
        assert short.status_code == 200


KEY = {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": pack_kv_rank(1, 0, 1, 0)}
LONG = {"keys": [{**KEY, "chunk_hash_hex": f"{i:064x}"} for i in range(256)]}
"""A 64k-token prompt's keys: a body over the lookup's ``INLINE_BODY_BYTES`` (the pool's)."""


class HeldLookups:
    """``CoordinatorService.lookup_keys`` patched to note its thread and count itself in
    (``started``), then wait for ``release`` (``why``: the failure if it never comes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
        self.started, self.release = threading.Semaphore(0), threading.Event()
        self.threads: list[str] = []
        real = CoordinatorService.lookup_keys

        def held(service: CoordinatorService, keys: Any, *limits: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            self.started.release()
            if not self.release.wait(30):
                raise AssertionError(why)
            return real(service, keys, *limits)

        monkeypatch.setattr(CoordinatorService, "lookup_keys", held)


def test_a_prefix_lookup_is_answered_on_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole lookup (body, query, directory, reply) of a body over ``INLINE_BODY_BYTES``
    runs on one of the lookup pool's threads, as many as the cores: while it runs, /healthz
    answers on the loop."""
    assert len(json.dumps(LONG, separators=(",", ":"))) > service_module.INLINE_BODY_BYTES
    held = HeldLookups(monkeypatch, "/healthz did not answer while a lookup was answered")
    with (
        running() as (server, c),
        httpx.Client(base_url=server.url, timeout=30) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        reply = pool.submit(c.post, "/directory/lookup", json=LONG)
        assert held.started.acquire(timeout=30)
        assert other.get("/healthz").status_code == 200
        held.release.set()
        result = reply.result()
        assert result.status_code == 200, result.text
        assert result.json()["results"][0]["placements"] == []
    assert len(held.threads) == 1 and held.threads[0].startswith("kvatlas-lookup"), held.threads


def test_a_short_prefix_lookup_is_answered_on_the_loop_while_the_directory_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup of a few keys (a body up to ``INLINE_BODY_BYTES``) is answered on the event
    loop, with no hop to the pool; while a change holds the directory it goes to the pool, so
    the loop never waits for the lock: /healthz answers meanwhile."""
    threads: list[str] = []
    real = CoordinatorService.lookup_keys

    def noted(service: CoordinatorService, keys: Any, *limits: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(service, keys, *limits)

    monkeypatch.setattr(CoordinatorService, "lookup_keys", noted)
    with (
        running() as (server, c),
        httpx.Client(base_url=server.url, timeout=30) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        assert c.post("/directory/lookup", json={"keys": [KEY]}).status_code == 200
        assert not threads[0].startswith("kvatlas-lookup"), threads
        with server.service.directory._lock:  # a change holds the directory
            reply = pool.submit(c.post, "/directory/lookup", json={"keys": [KEY]})
            assert _arrived(threads, 2)  # (and waits for the lock)
            assert threads[1].startswith("kvatlas-lookup"), threads
            assert other.get("/healthz").status_code == 200
            assert not reply.done()
        assert reply.result().status_code == 200


def _arrived(threads: list[str], n: int) -> bool:
    """Whether ``threads`` (a patched handler's record) gets its ``n``-th entry in time."""
    deadline = time.monotonic() + 30
    while len(threads) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(threads) >= n


def test_prefix_lookups_filling_their_pool_hold_up_no_blend_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As many lookups in flight as the lookup pool has threads: a long blend lookup (the
    match pool's) is still answered meanwhile."""
    threads = max(2, os.cpu_count() or 2)
    held = HeldLookups(monkeypatch, "the blend lookup was not answered while lookups were held")
    tokens = np.arange(blend_lookup.INLINE_BODY_BYTES // 4, dtype="<u4")  # off the loop
    blend = {"tokens_b64": base64.b64encode(tokens.tobytes()).decode(), "model_name": "m"}
    with (
        running(enable_blend_lookup=True) as (server, _),
        ThreadPoolExecutor(threads) as pool,
    ):

        def post(path: str, body: Any) -> httpx.Response:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                return client.post(path, json=body)

        lookups = [pool.submit(post, "/directory/lookup", LONG) for _ in range(threads)]
        for _ in range(threads):
            assert held.started.acquire(timeout=30)
        assert post("/directory/blend-lookup", blend).status_code == 200
        held.release.set()
        assert [r.result().status_code for r in lookups] == [200] * threads


def _store_body(instance: str, seq: int, tokens: int) -> bytes:
    """A ``POST /events`` body storing one chunk of ``tokens`` ids (msgpack)."""
    key = ObjectKey(seq.to_bytes(32, "big"), "m", pack_kv_rank(1, 0, 1, 0))
    entry = CacheEntry(key, 1, np.arange(tokens, dtype=np.uint32), UNKNOWN_OFFSET)
    return encode_msgpack([EventBatch(instance, 1, seq, "store", "l1", "dram", entries=(entry,))])


def test_a_small_events_body_is_applied_on_the_loop_while_the_directory_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node's batch of a chunk (a body up to ``INLINE_BODY_BYTES``) is applied on the event
    loop, with no hop to the ingest pool; a larger body on the pool; and a small body while a
    change holds the directory goes to the pool too, so the loop never waits for the lock:
    /healthz answers meanwhile, and the body is applied once the directory is free."""
    threads: list[str] = []
    real = events_ingest.EventsIngest.answer

    def noted(self: events_ingest.EventsIngest, *args: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(events_ingest.EventsIngest, "answer", noted)
    headers = {"content-type": "application/msgpack"}
    small, large = _store_body("node", 1, 16), _store_body("node", 2, 8192)
    assert len(small) <= service_module.INLINE_BODY_BYTES < len(large)
    with (
        running(chunk_size=16) as (server, c),
        httpx.Client(base_url=server.url, timeout=30) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        assert c.post("/events", content=small, headers=headers).status_code == 200
        assert c.post("/events", content=large, headers=headers).status_code == 200
        assert not threads[0].startswith("kvatlas-ingest"), threads
        assert threads[1].startswith("kvatlas-ingest"), threads
        directory_lock = server.service.directory._lock
        with directory_lock:  # a change holds the directory
            reply = pool.submit(c.post, "/events", content=_store_body("node", 3, 16),
                                headers=headers)  # fmt: skip
            assert _arrived(threads, 3)  # (and waits for the lock)
            assert threads[2].startswith("kvatlas-ingest"), threads
            assert other.get("/healthz").status_code == 200
            assert not reply.done()
        assert reply.result().json()["applied"] == 1
