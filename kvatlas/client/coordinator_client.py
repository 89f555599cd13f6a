"""CoordinatorClient: registration with a heartbeat thread, prefix lookups, stats.

Unlike the blend client this one raises :class:`CoordinatorError` on failure: registration
and routing decisions want to know that the coordinator could not answer.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import numpy as np

from kvatlas.api import (
    DigestBody,
    DigestReply,
    ErrorReply,
    HealthReply,
    HealthReplyAnyRelease,
    HeartbeatReply,
    InstanceRow,
    InstancesReply,
    LookupReply,
    RegisteredReply,
    decode,
    encode,
)
from kvatlas.api.cache_control import MAX_PIN_PAGE, PinRow, PinsReply
from kvatlas.checks import uint32_token_bytes
from kvatlas.errors import Unavailable, Unprocessable
from kvatlas.keys import ObjectKey, check_instance_id

log = logging.getLogger(__name__)

JSON_HEADERS = {"content-type": "application/json"}


class CoordinatorError(Unavailable):
    """The coordinator could not answer, or refused (an ``Unavailable``, so a ``RuntimeError``).

    ``reply_status`` is the HTTP status the coordinator replied with (``None`` when no reply
    arrived); ``status`` is, as for every ``KvatlasError``, what this error maps to (503);
    ``request_id``: the command the coordinator kept for retry (a prefetch's 502).
    """

    def __init__(
        self, message: str, reply_status: int | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.reply_status = reply_status
        self.request_id = request_id


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def encode_tokens_b64(token_ids: Any) -> str:
    """Query tokens as base64 of little-endian uint32 (the wire form of blend lookups)."""
    return base64.b64encode(uint32_token_bytes(token_ids)).decode("ascii")


def read_reply(method: str, path: str, status: int, raw: bytes, reply: Any = Any) -> Any:
    """A coordinator reply as its wire type ``reply`` (:mod:`kvatlas.api`; ``None`` for an
    empty one), or :class:`CoordinatorError`: with the reply's ``detail`` for a refusal, naming
    the bad field for a reply that is not of its type. The one reading of a reply, whichever
    HTTP client (httpx here, ``kvatlas.client.keepalive`` in the router) carried it."""
    if status >= 400:
        detail, kept = _detail(raw)
        raise CoordinatorError(f"{method} {path}: {status} {detail}", status, kept)
    if not raw:
        return None  # 204 (LMCache's DELETE /instances/{id})
    try:
        return decode(raw, reply, "reply")
    except Unprocessable as exc:  # it answered, but not as a coordinator does
        found = raw[:80].decode("utf-8", "replace")
        raise CoordinatorError(
            f"{method} {path}: malformed {exc} (the reply began {found!r})", status
        ) from None


def _detail(raw: bytes) -> tuple[str, str | None]:
    """The ``detail`` of an error reply (saying the ``request_id`` of a command kept for
    retry), else its text (at most 200 characters); and that ``request_id``."""
    try:
        error = msgspec.json.decode(raw, type=ErrorReply)
    except msgspec.MsgspecError:
        return raw[:200].decode("utf-8", "replace"), None
    if error.detail is None:
        return raw[:200].decode("utf-8", "replace"), None
    kept = f" (kept for retry: request_id {error.request_id})" if error.request_id else ""
    return f"{error.detail}{kept}", error.request_id


def call_json(http: httpx.Client, method: str, path: str, reply: Any = Any, **kwargs: Any) -> Any:
    """One request's reply as ``reply`` (:func:`read_reply`); no answer is a
    :class:`CoordinatorError` too."""
    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise CoordinatorError(f"{method} {path}: {exc}") from exc
    return read_reply(method, path, response.status_code, response.content, reply)


class CoordinatorClient:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=auth_headers(token))
        self.instance_id: str | None = None
        self._registration: dict[str, Any] = {}
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self.heartbeat_failures = 0
        self.failures = 0  # every call that raised CoordinatorError (node /metrics)
        self.on_resync: Callable[[], object] | None = None
        """Called after every (re-)registration and when a heartbeat reply asks for a digest
        exchange (``resync: true``; see docs/coordinator.md, "Resync")."""
        self.on_list_all: Callable[[], object] | None = None
        """Called instead when a heartbeat reply asks for a listing of everything the node
        holds (``list_all: true``: a replica lost events; docs/coordinator.md, "Stream
        retention"); without it, ``on_resync`` is."""

    def _want_resync(self, list_all: bool = False) -> None:
        hook = (list_all and self.on_list_all) or self.on_resync
        if hook is not None:
            hook()

    def _call(self, method: str, path: str, reply: Any = Any, **kwargs: Any) -> Any:
        try:
            return call_json(self._http, method, path, reply, **kwargs)
        except CoordinatorError:
            self.failures += 1
            raise

    # ------------------------------------------------------------------ instances

    def register(
        self,
        instance_id: str | None = None,
        *,
        ip: str = "",
        http_port: int | None = None,
        metadata: dict[str, Any] | None = None,
        p2p_advertised_url: str | None = None,
        chunk_size: int | None = None,
        p2p_url_signature: str | None = None,
        engine_id: str | None = None,
    ) -> str:
        """Register (``instance_id`` ``None``: the coordinator assigns one). The body is what
        LMCache's coordinator accepts too: its defaults (``""``) for what is not given, and
        ``chunk_size`` (a 0.5.7 coordinator refuses a conflicting one with 409);
        ``p2p_url_signature`` (a kvatlas node's, docs/security.md) and ``engine_id`` (the
        engine the node serves, docs/route-scoring.md) only when given."""
        body: dict[str, Any] = {
            "instance_id": instance_id or "",
            "ip": ip,
            "metadata": metadata or {},
            "p2p_advertised_url": p2p_advertised_url or "",
        }
        if http_port is not None:
            body["http_port"] = http_port
        if chunk_size is not None:
            body["chunk_size"] = chunk_size
        if p2p_url_signature:
            body["p2p_url_signature"] = p2p_url_signature
        if engine_id:
            body["engine_id"] = engine_id
        reply: RegisteredReply = self._call("POST", "/instances", RegisteredReply, json=body)
        try:  # it names a directory under the node's L2 root: never trust it unchecked
            self.instance_id = check_instance_id(reply.instance_id)
        except ValueError as exc:
            raise CoordinatorError(f"POST /instances: unusable instance id: {exc}") from None
        self._registration = body | {"instance_id": self.instance_id}
        self._want_resync()
        return self.instance_id

    def heartbeat(self) -> None:
        """One heartbeat; re-registers (same id) when the coordinator forgot the instance."""
        if self.instance_id is None:
            raise CoordinatorError("register() first")
        try:
            reply = self._call("PUT", self._own("/heartbeat"), HeartbeatReply)
        except CoordinatorError as exc:
            if exc.reply_status != 404:
                raise
            log.warning("coordinator forgot instance %s; re-registering", self.instance_id)
            self._call("POST", "/instances", json=self._registration)
            self._want_resync()
            return
        if reply is not None and (reply.resync is True or reply.list_all is True):
            self._want_resync(reply.list_all is True)

    def report(self, body: dict[str, Any]) -> None:
        """``PUT /instances/{id}/report``: this node's value counters and tiers."""
        if self.instance_id is None:
            raise CoordinatorError("register() first")
        self._call("PUT", self._own("/report"), json=body)

    def start_heartbeat(
        self, interval: float = 5.0, report: Callable[[], dict[str, Any]] | None = None
    ) -> None:
        """Heartbeat every ``interval`` seconds; with ``report``, send its value report
        after each heartbeat (cumulative counters: a lost one is repaired by the next)."""
        if self._heartbeat_thread is not None:
            return
        self._heartbeat_stop.clear()

        def loop() -> None:
            while not self._heartbeat_stop.wait(interval):
                try:
                    self.heartbeat()
                    if report is not None:
                        self.report(report())
                except CoordinatorError as exc:
                    self.heartbeat_failures += 1
                    log.warning("heartbeat failed: %s", exc)

        self._heartbeat_thread = threading.Thread(
            target=loop, name="kvatlas-heartbeat", daemon=True
        )
        self._heartbeat_thread.start()

    def stop_heartbeat(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
            self._heartbeat_thread = None

    def exchange_digests(self, tiers: dict[str, dict[str, str]]) -> dict[str, list[str]]:
        """``POST /instances/{id}/digest``: digests (hex) by tier and prefix hex → the child
        prefixes whose buckets differ, by tier."""
        if self.instance_id is None:
            raise CoordinatorError("register() first")
        path = self._own("/digest")
        body = encode(DigestBody(tiers=tiers))
        reply: DigestReply = self._call(
            "POST", path, DigestReply, content=body, headers=JSON_HEADERS
        )
        return reply.tiers

    def _own(self, tail: str = "") -> str:
        """This instance's path (``tail`` after it): its id as one path segment, encoded
        (an id may hold ``# ? %`` and spaces)."""
        return f"/instances/{quote(str(self.instance_id), safe='')}{tail}"

    def deregister(self) -> None:
        self.stop_heartbeat()
        if self.instance_id is not None:
            self._call("DELETE", self._own())

    # ------------------------------------------------------------------ lookups

    def lookup_keys(self, keys: Sequence[ObjectKey]) -> LookupReply:
        """Placements per key, in the order of ``keys``."""
        body = {"keys": [k.to_wire() for k in keys]}
        reply: LookupReply = self._call("POST", "/directory/lookup", LookupReply, json=body)
        return reply

    def lookup_tokens(
        self, token_ids: Any, model_name: str, world_size: int = 1, cache_salt: str = ""
    ) -> LookupReply:
        """Prefix lookup; ``prefix`` is the per-holder leading-chunk summary (kvatlas only).
        Tokens go as ``token_ids``, the form LMCache's coordinator reads too."""
        body = {
            "token_ids": np.asarray(token_ids, dtype=np.uint32).tolist(),
            "model_name": model_name,
            "world_size": world_size,
            "cache_salt": cache_salt,
        }
        reply: LookupReply = self._call("POST", "/directory/lookup", LookupReply, json=body)
        return reply

    def instances(self) -> list[InstanceRow]:
        """``GET /instances``: liveness, cursors and each instance's advertised peer URL."""
        reply: InstancesReply = self._call("GET", "/instances", InstancesReply)
        return reply.instances

    def pins(self, model_name: str = "", page_size: int = MAX_PIN_PAGE) -> list[PinRow]:
        """``GET /instances/{id}/pins``, every page: this instance's pins (its model's keys in
        its token's salts), first pinned first."""
        if self.instance_id is None:
            raise CoordinatorError("register() first")
        rows: list[PinRow] = []
        while True:
            params = {"model_name": model_name, "offset": len(rows), "limit": page_size}
            page: PinsReply = self._call("GET", self._own("/pins"), PinsReply, params=params)
            rows.extend(page.pins)
            if not page.pins or len(rows) >= page.total:
                return rows

    def stats(self) -> dict[str, Any]:
        reply: dict[str, Any] = self._call("GET", "/directory/stats")
        return reply

    def health(self) -> HealthReply:
        """``GET /healthz`` (of a coordinator of this release or the one before)."""
        reply: HealthReply = self._call("GET", "/healthz", HealthReplyAnyRelease)
        return reply

    def close(self) -> None:
        self.stop_heartbeat()
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
