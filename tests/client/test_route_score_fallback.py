"""The router's score client (``AsyncRouteClient``) against a coordinator older than its msgpack
body, as a real loopback HTTP server: such a coordinator reads every body as JSON and answers
msgpack 422 ``body: JSON is malformed: invalid character (byte 0)`` (what the coordinator of
f88338f^ answers, checked by running it); one that refuses the content type answers 415. The
client scores with the JSON body instead, remembers it for ``JSON_RETRY_S``, warns once and
counts each fallback; a refusal of the JSON body too is the query's own (negative control).
(The old client raised on every score: the router routed every request by load.)"""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvatlas.client.route_client import JSON_RETRY_S, AsyncRouteClient
from tests.client.test_keepalive import Handler, _read_request, _serve

OLD_422 = b'{"detail":"body: JSON is malformed: invalid character (byte 0)"}'
SCORES = (
    b'{"instances":[{"instance_id":"e1","score":32.0,"prefix_tokens":32,"fragment_tokens":0,'
    b'"by_tier":{"gpu":0,"l1":32,"l2":0,"peer":0}}],"query_tokens":64}'
)


def _reply(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


def _old_coordinator(refusal: bytes, seen: list[bytes], json_too: bool = False) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await _read_request(reader)) is not None:
            head = request.split(b"\r\n\r\n")[0].lower()
            kind = b"msgpack" if b"content-type: application/msgpack" in head else b"json"
            seen.append(kind)
            writer.write(refusal if kind == b"msgpack" or json_too else _reply(b"200 OK", SCORES))

    return handler


@pytest.mark.parametrize(
    "refusal",
    [_reply(b"422 Unprocessable Entity", OLD_422), _reply(b"415 Unsupported Media Type", b"{}")],
    ids=["422-old-coordinator", "415"],
)
def test_a_coordinator_that_refuses_msgpack_is_scored_with_json(
    refusal: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[bytes] = []
    now = [1000.0]
    fallbacks: list[int] = []

    async def main() -> None:
        server, url, _ = await _serve(_old_coordinator(refusal, seen))
        client = AsyncRouteClient(url, on_json_fallback=lambda: fallbacks.append(1),
                                  clock=lambda: now[0])  # fmt: skip
        try:
            for _ in range(3):
                scores = await client.score(list(range(64)), "m", instances=["e1"])
                assert [r.instance_id for r in scores.instances] == ["e1"]
            assert seen == [b"msgpack", b"json", b"json", b"json"]  # remembered
            now[0] += JSON_RETRY_S + 1  # later: msgpack is tried again, still refused
            await client.score(list(range(64)), "m")
            assert seen[4:] == [b"msgpack", b"json"]
        finally:
            await client.aclose()
            server.close()

    with caplog.at_level(logging.DEBUG, logger="kvatlas.client.route_client"):
        asyncio.run(main())
    assert fallbacks == [1, 1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused the msgpack score body" in warnings[0].getMessage()


def test_a_refusal_of_both_bodies_is_the_querys_own_and_not_remembered() -> None:
    seen: list[bytes] = []
    fallbacks: list[int] = []
    refusal = _reply(b"422 Unprocessable Entity", b'{"detail":"model_name: required"}')

    async def main() -> None:
        server, url, _ = await _serve(_old_coordinator(refusal, seen, json_too=True))
        client = AsyncRouteClient(url, on_json_fallback=lambda: fallbacks.append(1))
        try:
            for _ in range(2):
                with pytest.raises(Exception, match="422 model_name: required"):
                    await client.score(list(range(64)), "m")
        finally:
            await client.aclose()
            server.close()

    asyncio.run(main())
    assert seen == [b"msgpack", b"json"] * 2 and fallbacks == []


def test_the_router_counts_each_fallback() -> None:
    from kvatlas.router.app import Router
    from kvatlas.router.config import RouterConfig

    router = Router(RouterConfig(engine="a=http://127.0.0.1:9", coordinator_url="http://c"))
    assert router.coordinator is not None and router.coordinator.on_json_fallback is not None
    router.coordinator.on_json_fallback()
    value = router.metrics.registry.get_sample_value("kvatlas_router_score_json_fallbacks_total")
    assert value == 1.0
