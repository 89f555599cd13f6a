"""Peer reads: nodes read each other's L1 (and, on request, private L2) over HTTP (the
stand-in for RDMA P2P, ``docs/node.md``).

Protocol: ``POST /peer/kv`` with JSON ``{"keys": [ObjectKey wire objects], "tiers": ["l1"]}``
(``tiers`` optional, default ``["l1"]``; any non-empty subset of ``"l1"``, ``"l2"``); the reply
is ``application/octet-stream``, a msgpack array of one map per listed key this node holds in
one of the asked tiers (L1 first):
``{"chunk": <encode_chunk bytes, without token ids>, "tokens_digest": <32 bytes | nil>}``.
Missing keys are simply omitted, so a sparse key set with gaps is one round trip.

* Token ids never leave the node: they would hand one tenant's prompt to whoever asks. The
  reply carries :func:`~kvatlas.node.chunk_digest.tokens_digest` of them instead, and the
  requester compares it with the digest of its own request's tokens at that position.
* The listed keys are pinned in L1 while the reply is assembled: a put storm on this node must
  not evict a chunk between "listed" and "serialized" (with RDMA the peer reads the memory
  directly, so the pin is what keeps it valid).
* A peer reads its *private* L2 only when asked (``"l2"`` in ``tiers``): a placement in a
  node's private L2 is otherwise a promise no one can keep. A plain fetch stays a cheap memory
  read (the requester asks for L2 separately, after cheaper sources, so an L2 read is never
  hidden behind a call budgeted as "peer L1"). A shared pool is never served: the requester
  reads it itself.
* Serving chunks touches them in the serving L1's LRU: a chunk peers keep asking for is worth
  keeping.

:class:`PeerClient` never raises into its caller: peer data is an optimisation, so a peer that
is down, slow, hostile or replies with garbage costs at most ``deadline`` (for the whole call,
however slowly it drips) and a reply no larger than the keys asked for can fill
(:mod:`kvatlas.node.bounded_http`), and yields misses with the cause in
:attr:`PeerReply.failure`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp

from kvatlas.api import decode
from kvatlas.api.events import EventKey
from kvatlas.api.peer import (
    DEFAULT_TIERS,
    PEER_TIERS,
    PeerFetch,
    PeerFetchOf,
    PeerRecord,
)
from kvatlas.asgi_thread import ThreadedServer
from kvatlas.dispatch import Dispatcher
from kvatlas.errors import InvalidInput, PayloadTooLarge, Unprocessable
from kvatlas.keys import ObjectKey
from kvatlas.logs import Throttle
from kvatlas.node.bounded_http import BoundedClient, CallFailed
from kvatlas.node.chunk_digest import TOKENS_DIGEST_BYTES, tokens_digest
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend
from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk, decode_chunk, encode_chunk
from kvatlas.routing import Access, Call, Reply, Route, RouteTable

log = logging.getLogger(__name__)

PEER_KV_PATH: Final = "/peer/kv"
MAX_KEYS_PER_REQUEST: Final = 4096
MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024  # ~4096 keys x ~250 B of JSON each, with headroom
OCTET_STREAM: Final = "application/octet-stream"
RECORD_OVERHEAD: Final = 512
"""Bytes of one reply record beyond its KV, tokens and key: chunk header and checksum, the
digest, msgpack framing (a real record uses about half)."""
BAD_REPLY: Final = "bad_reply"
"""A :attr:`PeerReply.failure`: the reply was not a msgpack array of records."""


class PeerChunk(NamedTuple):
    """A chunk a peer sent and the digest of its tokens (the chunk itself carries none)."""

    chunk: StoredChunk
    tokens_digest: bytes | None


@dataclass(frozen=True, slots=True)
class PeerReply:
    """What one fetch from one peer yielded. ``failure`` says why nothing came back (a
    :mod:`~kvatlas.node.bounded_http` cause or :data:`BAD_REPLY`; empty when the call
    succeeded); ``dropped`` counts records refused from a good reply (corrupt, not asked for,
    malformed digest)."""

    chunks: dict[ObjectKey, PeerChunk] = field(default_factory=dict)
    failure: str = ""
    dropped: int = 0


_request_decoder = msgspec.json.Decoder(PeerFetchOf[msgspec.Raw])  # keys read one by one
_reply_decoder = msgspec.msgpack.Decoder(list[PeerRecord])
_reply_encoder = msgspec.msgpack.Encoder()
_key_encoder = msgspec.msgpack.Encoder()


def _parse_request(body: bytes, max_keys: int) -> tuple[list[ObjectKey], frozenset[str]]:
    """The distinct keys of a fetch request, in order, and the tiers asked for; refusals are
    :mod:`kvatlas.errors`."""
    try:
        parsed = _request_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"invalid request body: {exc}") from None
    tiers = parsed.tier_set
    if not tiers or not tiers <= set(PEER_TIERS):
        raise Unprocessable(f"tiers must be a non-empty subset of {list(PEER_TIERS)}")
    if len(parsed.keys) > max_keys:
        raise PayloadTooLarge(f"{len(parsed.keys)} keys exceed the limit of {max_keys}")
    keys: list[ObjectKey] = []
    for i, raw in enumerate(parsed.keys):
        wire = decode(raw, EventKey, f"keys[{i}]")
        try:
            keys.append(ObjectKey.from_wire(wire.as_dict()))
        except (ValueError, TypeError) as exc:
            raise Unprocessable(f"keys[{i}]: {exc}") from None
    return list(dict.fromkeys(keys)), tiers


def _reply_record(chunk: StoredChunk, encoder: Callable[[StoredChunk], bytes]) -> PeerRecord:
    """The chunk without its token ids, and their digest."""
    bare = StoredChunk(chunk.key, chunk.kv, None, chunk.token_offset, chunk.kv_dtype)
    digest = None if chunk.tokens is None else tokens_digest(chunk.tokens)
    return PeerRecord(memoryview(encoder(bare)), digest)


class PeerServing:
    """What ``POST /peer/kv`` serves: ``l1`` and, when it is private, ``l2`` (only to requests
    that ask for ``"l2"``). ``encoder`` is the per-chunk serializer (a seam for tests that need
    a slow one to hold a transfer open)."""

    def __init__(
        self,
        l1: L1Cache,
        l2: L2Backend | None = None,
        encoder: Callable[[StoredChunk], bytes] = encode_chunk,
        max_keys: int = MAX_KEYS_PER_REQUEST,
    ) -> None:
        self.l1 = l1
        self.private_l2 = l2 if l2 is not None and not l2.shared else None
        self.encoder = encoder
        self.max_keys = max_keys

    def assemble(self, keys: list[ObjectKey], tiers: frozenset[str]) -> bytes:
        records = []
        missing = keys
        if "l1" in tiers:
            # Pinned for the whole assembly: a key present when listed stays present until
            # its bytes are in the reply, whatever other threads put meanwhile.
            missing = []
            with self.l1.pinned(keys):
                for key in keys:
                    chunk = self.l1.get(key)
                    if chunk is not None:
                        records.append(_reply_record(chunk, self.encoder))
                    else:
                        missing.append(key)
        if "l2" in tiers and self.private_l2 is not None and missing:
            for chunk in self.private_l2.get_many(missing).values():
                records.append(_reply_record(chunk, self.encoder))
        return _reply_encoder.encode(records)


class ServesPeers(Protocol):
    """A route context that serves ``/peer/kv``."""

    @property
    def peer(self) -> PeerServing: ...


async def peer_kv(context: ServesPeers, call: Call[None, None]) -> Reply:
    """Chunks of this node's L1 (and private L2 on request) by key, token ids replaced by their
    digest."""
    serving = context.peer
    keys, tiers = _parse_request(call.raw, serving.max_keys)
    # Encoding MB-sized chunks (and reading L2) is blocking work: off the event loop so one
    # transfer does not stall the others.
    reply = await run_in_threadpool(serving.assemble, keys, tiers)
    return Reply(reply, media_type=OCTET_STREAM)


def peer_route(access: Access) -> Route:
    """The ``/peer/kv`` entry of a route table, called under ``access``; bodies of at most
    :data:`MAX_REQUEST_BYTES`."""
    return Route(
        "POST", PEER_KV_PATH, access, peer_kv, "Fetch chunks by key (msgpack records)",
        request=bytes, media_type=OCTET_STREAM, body=lambda _limits: MAX_REQUEST_BYTES,
        docs={"requestBody": {"required": True, "content": {"application/json": {
            "schema": msgspec.json.schema(PeerFetch)}}}},
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _PeerOnly:
    peer: PeerServing


def create_peer_app(
    l1: L1Cache,
    *,
    l2: L2Backend | None = None,
    encoder: Callable[[StoredChunk], bytes] = encode_chunk,
    max_keys: int = MAX_KEYS_PER_REQUEST,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> Dispatcher:
    """An app serving only the peer route over :class:`PeerServing` (no auth: the node's app,
    :func:`kvatlas.node.http_api.create_node_app`, serves the same route behind its access
    checks). Every client error is a 4xx with a JSON ``detail``."""
    table = RouteTable([peer_route(Access())], unrouted=Access(open=True))
    context = _PeerOnly(PeerServing(l1, l2, encoder, max_keys))
    return Dispatcher(
        context, table, None, frozenset(), lambda _route: max_request_bytes, max_request_bytes
    )


def max_chunk_bytes(layout: KVLayout) -> int:
    """The most KV and token bytes one chunk of ``layout`` can take in a reply."""
    return layout.chunk_bytes + 4 * layout.chunk_size


class PeerClient:
    """Fetch chunks from one peer's L1; failures become absent keys, never exceptions.

    ``max_chunk_bytes`` (:func:`max_chunk_bytes` of the node's layout) bounds each chunk of a
    reply, so a reply may be at most about ``len(keys) * max_chunk_bytes``: more is refused as
    it streams in. ``deadline`` bounds the whole call. ``token`` is sent as
    ``Authorization: Bearer`` on every call (the credential derived for this peer,
    :mod:`kvatlas.node.peer_credentials`, when the fleet runs with auth).
    Failures are logged at most once a minute per client (one client per peer).
    """

    def __init__(
        self,
        url: str,
        *,
        max_chunk_bytes: int,
        deadline: float = 2.0,
        token: str | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_chunk_bytes = max_chunk_bytes
        self.deadline = deadline
        self._headers = {"content-type": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._client = BoundedClient()
        self._throttle = throttle or Throttle(60.0)

    def reply_bound(self, keys: Sequence[ObjectKey]) -> int:
        """The most bytes a reply to a request for ``keys`` may take."""
        per_chunk = self.max_chunk_bytes + RECORD_OVERHEAD
        return 16 + sum(per_chunk + len(_key_encoder.encode(k.to_wire())) for k in keys)

    def fetch(self, keys: Iterable[ObjectKey], tiers: Sequence[str] = DEFAULT_TIERS) -> PeerReply:
        """The chunks the peer holds in ``tiers`` (see the module docstring)."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return PeerReply()
        request = PeerFetch([EventKey(**k.to_wire()) for k in wanted])
        if tuple(tiers) != DEFAULT_TIERS:  # the default stays the bare form older peers read
            request.tiers = list(tiers)
        body = msgspec.json.encode(request)
        try:
            reply = self._client.post(
                self.url + PEER_KV_PATH, body, headers=self._headers,
                deadline_s=self.deadline, max_reply_bytes=self.reply_bound(wanted),
            )  # fmt: skip
            records = _reply_decoder.decode(reply)
        except CallFailed as exc:
            self._warn("fetch of %d keys failed (%s): %s", len(wanted), exc.cause, exc)
            return PeerReply(failure=exc.cause)
        except msgspec.DecodeError as exc:
            self._warn("sent a malformed reply: %s", exc)
            return PeerReply(failure=BAD_REPLY)
        return self._accept(records, set(wanted))

    def _accept(self, records: list[PeerRecord], wanted: set[ObjectKey]) -> PeerReply:
        found: dict[ObjectKey, PeerChunk] = {}
        dropped = 0
        for record in records:
            digest = record.tokens_digest
            try:
                chunk = decode_chunk(record.chunk)
            except ChunkDecodeError as exc:
                self._warn("sent a corrupt chunk: %s", exc)
                dropped += 1
                continue
            # an unrequested key is never trusted into the caller
            if chunk.key not in wanted or (
                digest is not None and len(digest) != TOKENS_DIGEST_BYTES
            ):
                dropped += 1
                continue
            found[chunk.key] = PeerChunk(chunk, digest)
        return PeerReply(found, dropped=dropped)

    def _warn(self, message: str, *args: object) -> None:
        if self._throttle(self.url):
            log.warning("peer %s " + message, self.url, *args)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerServer(ThreadedServer):
    """Serve an app (normally :func:`create_peer_app`) with uvicorn in a daemon thread."""

    def __init__(self, app: ASGIApp, *, port: int, host: str = "127.0.0.1") -> None:
        super().__init__(app, port=port, host=host, name="peer")
        self.app = app

    def start(self, timeout: float = 20.0) -> PeerServer:  # type: ignore[override]
        super().start(timeout)
        return self

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
