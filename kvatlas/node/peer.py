"""Peer L1: nodes read each other's L1 over HTTP (the stand-in for RDMA P2P, ``docs/node.md``).

Protocol: ``POST /peer/kv`` with JSON ``{"keys": [ObjectKey wire objects]}`` (and, when the
serving node has auth on, ``Authorization: Bearer <peer token>``); the reply is
``application/octet-stream``, a msgpack array with one :class:`PeerRecord` ``[chunk,
token_digest]`` per listed key this node holds in L1. Missing keys are simply omitted, so a
sparse key set with gaps is one round trip.

* A reply never carries token ids (they are a tenant's prompt): ``chunk`` is the
  :func:`encode_chunk` record of the chunk *without* its tokens, ``token_digest`` is
  :func:`chunk_tokens_digest` of its tokens (``b""`` when it has none). The requester compares
  the digest with the digest of its own request's tokens at that position and attaches those
  tokens only on a match.

* The listed keys are pinned in L1 while the reply is assembled: a put storm on this node must
  not evict a chunk between "listed" and "serialized" (with RDMA the peer reads the memory
  directly, so the pin is what keeps it valid).
* A peer answers from its L1 only and never reads its own L2: a peer fetch is meant to be a
  cheap memory read, and a recursive fetch would hide an L2 read (and its latency) behind a
  call the requester already budgeted as "peer L1". The requester reads shared L2 itself.
* Serving chunks touches them in the serving L1's LRU: a chunk peers keep asking for is worth
  keeping.

:class:`PeerClient` never raises into its caller: peer data is an optimisation, so a peer that
is down, slow, or replies with garbage costs at most ``timeout`` and yields misses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Final

import blake3
import httpx
import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvatlas.asgi_thread import ThreadedServer
from kvatlas.errors import InvalidInput, KvatlasError, PayloadTooLarge, Unprocessable
from kvatlas.keys import ObjectKey
from kvatlas.node.l1 import L1Cache
from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk, decode_chunk, encode_chunk
from kvatlas.web import error_response, read_body

log = logging.getLogger(__name__)

PEER_KV_PATH: Final = "/peer/kv"
MAX_KEYS_PER_REQUEST: Final = 4096
MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024  # ~4096 keys x ~250 B of JSON each, with headroom
OCTET_STREAM: Final = "application/octet-stream"


class _FetchRequest(msgspec.Struct, forbid_unknown_fields=True):
    keys: list[dict[str, Any]]


class PeerRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One chunk of a ``/peer/kv`` reply: its record without token ids, and their digest."""

    chunk: bytes
    token_digest: bytes


def chunk_tokens_digest(tokens: Any) -> bytes:
    """blake3 (32 bytes) of a chunk's token ids as little-endian uint32 bytes."""
    return blake3.blake3(np.asarray(tokens, dtype="<u4").tobytes()).digest()


def peer_record(chunk: StoredChunk, encoder: Callable[[StoredChunk], bytes]) -> PeerRecord:
    if chunk.tokens is None:
        return PeerRecord(encoder(chunk), b"")
    return PeerRecord(encoder(replace(chunk, tokens=None)), chunk_tokens_digest(chunk.tokens))


_request_decoder = msgspec.json.Decoder(_FetchRequest)
_reply_decoder = msgspec.msgpack.Decoder(list[PeerRecord])
_reply_encoder = msgspec.msgpack.Encoder()


def _parse_keys(body: bytes, max_keys: int) -> list[ObjectKey]:
    """The distinct keys of a fetch request, in order; refusals are :mod:`kvatlas.errors`."""
    try:
        parsed = _request_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"invalid request body: {exc}") from None
    if len(parsed.keys) > max_keys:
        raise PayloadTooLarge(f"{len(parsed.keys)} keys exceed the limit of {max_keys}")
    keys: list[ObjectKey] = []
    for i, wire in enumerate(parsed.keys):
        try:
            keys.append(ObjectKey.from_wire(wire))
        except (ValueError, TypeError) as exc:
            raise Unprocessable(f"keys[{i}]: {exc}") from None
    return list(dict.fromkeys(keys))


def create_peer_app(
    l1: L1Cache,
    *,
    encoder: Callable[[StoredChunk], bytes] = encode_chunk,
    max_keys: int = MAX_KEYS_PER_REQUEST,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The peer-serving ASGI app over ``l1``.

    ``encoder`` is the per-chunk serializer (a seam for tests that need a slow one to hold a
    transfer open). Every client error is a 4xx with a JSON ``detail``, the reply
    :func:`kvatlas.web.error_response` makes for the error (answered here, so an app that
    mounts this route with handlers of its own still replies JSON on it).
    """
    app = FastAPI(title="kvatlas peer L1", docs_url=None, redoc_url=None)

    def assemble(keys: list[ObjectKey]) -> bytes:
        # Pinned for the whole assembly: a key present when listed stays present until its
        # bytes are in the reply, whatever other threads put meanwhile.
        with l1.pinned(keys):
            records = []
            for key in keys:
                chunk = l1.get(key)
                if chunk is not None:
                    records.append(peer_record(chunk, encoder))
        return _reply_encoder.encode(records)

    @app.post(PEER_KV_PATH)
    async def peer_kv(request: Request) -> Response:
        try:
            keys = _parse_keys(await read_body(request, max_request_bytes), max_keys)
        except KvatlasError as exc:
            return error_response(exc)
        # Encoding MB-sized chunks is CPU work: off the event loop so one transfer does not
        # stall the others.
        reply = await run_in_threadpool(assemble, keys)
        return Response(reply, media_type=OCTET_STREAM)

    return app


class PeerClient:
    """Fetch chunks from one peer's L1; failures become absent keys, never exceptions.

    ``max_reply_bytes`` bounds what one reply may make this process buffer (a confused or
    hostile peer must not be able to exhaust memory).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 2.0,
        max_reply_bytes: int = 1 << 30,
        token: str | None = None,
    ) -> None:
        """``token``: the peer bearer token sent on every call (a peer with auth needs one)."""
        self.url = url.rstrip("/")
        self.max_reply_bytes = max_reply_bytes
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._client = httpx.Client(timeout=timeout, headers=headers)

    def fetch(
        self, keys: Iterable[ObjectKey], tokens: Mapping[ObjectKey, Any] | None = None
    ) -> dict[ObjectKey, StoredChunk]:
        """The chunks of ``keys`` the peer holds. A chunk arrives without token ids; it carries
        the requester's own ``tokens[key]`` when their digest equals the reply's."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        try:
            records = self._request(wanted)
        except Exception as exc:  # peer data is optional: any failure is a miss
            log.warning("peer %s fetch of %d keys failed: %s", self.url, len(wanted), exc)
            return {}
        wanted_set = set(wanted)
        found: dict[ObjectKey, StoredChunk] = {}
        for record in records:
            try:
                chunk = decode_chunk(record.chunk)
            except ChunkDecodeError as exc:
                log.warning("peer %s sent a corrupt chunk: %s", self.url, exc)
                continue
            if chunk.key not in wanted_set:  # an unrequested key is never trusted into the caller
                continue
            mine = None if tokens is None else tokens.get(chunk.key)
            if mine is not None and record.token_digest == chunk_tokens_digest(mine):
                chunk = replace(chunk, tokens=mine)
            found[chunk.key] = chunk
        return found

    def _request(self, keys: list[ObjectKey]) -> list[PeerRecord]:
        body = {"keys": [k.to_wire() for k in keys]}
        with self._client.stream("POST", self.url + PEER_KV_PATH, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            parts: list[bytes] = []
            seen = 0
            for part in response.iter_bytes():
                seen += len(part)
                if seen > self.max_reply_bytes:
                    raise RuntimeError(f"reply exceeds {self.max_reply_bytes} bytes")
                parts.append(part)
        return _reply_decoder.decode(b"".join(parts))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerServer(ThreadedServer):
    """Serve an app (normally :func:`create_peer_app`) with uvicorn in a daemon thread."""

    def __init__(self, app: FastAPI, *, port: int, host: str = "127.0.0.1") -> None:
        super().__init__(app, port=port, host=host, name="peer")
        self.app = app

    def start(self, timeout: float = 20.0) -> PeerServer:  # type: ignore[override]
        super().start(timeout)
        return self

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
