"""The coordinator's client of an MP server's cache-control routes: LMCache's ``lmcache server``
and ``kvatlas node`` answer them alike (``docs/cache-control.md``), so one client drives both.
Replies are decoded with the wire types (:mod:`kvatlas.api.cache_control`): a reply that is not
of its type is refused whole, never half-read.

A refusal carries the server's status (``reply_status``: a 4xx means the command can never
apply, a 5xx that it may later); a server that cannot be reached has ``reply_status`` ``None``
(retry with backoff). Light on import: httpx and msgspec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvatlas.api.cache_control import (
    MAX_DELETE_KEYS,
    ClearReply,
    DeleteObjectsReply,
    EncodedKey,
    HoldReply,
    ObjectPage,
    PrefetchStatusReply,
    PrefetchSubmitted,
    ReleaseReply,
    TierName,
)
from kvatlas.client.coordinator_client import auth_headers
from kvatlas.errors import Unavailable

T = TypeVar("T")


class MPServerError(Unavailable):
    """An MP server refused or failed a call, or could not be reached (``reply_status``
    ``None``)."""

    def __init__(self, message: str, reply_status: int | None) -> None:
        super().__init__(message)
        self.reply_status = reply_status


def _segment(name: str) -> str:
    """``name`` (a caller's id) as one segment of the server's path, escaped: unescaped, ``/``,
    ``?`` or ``..`` in it steered the call to another route (with the node's admin token) and
    CR/LF made an invalid URL. ``.`` and ``..`` cannot be a segment (a URL resolves them): no
    server has such an id, so they are refused as unknown (404) without a call."""
    if name in (".", ".."):
        raise MPServerError(f"no resource is named {name!r}", 404)
    return quote(name, safe="")


class MPServerClient:
    """One MP server's cache-control routes (``url``: its HTTP base URL; ``token``: a bearer
    token, for a kvatlas node with auth on)."""

    def __init__(self, url: str, *, timeout: float = 30.0, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=auth_headers(token))

    def delete_objects(
        self, keys: Sequence[EncodedKey], tier: TierName = "all", *, force: bool = False
    ) -> DeleteObjectsReply:
        """``DELETE /cache/objects`` (``ok`` false with ``error``: the server's L2 failed).

        More keys than one call may carry (:data:`MAX_DELETE_KEYS`, LMCache's limit too) go in
        parts, counts summed; a part whose L2 failed ends the delete there, its reply carrying
        the copies removed before it (as one call's would)."""
        total = DeleteObjectsReply(deleted=0, skipped=0, ok=True)
        for start in range(0, max(len(keys), 1), MAX_DELETE_KEYS):
            part = list(keys[start : start + MAX_DELETE_KEYS])
            body = {"keys": part, "tier": tier, "force": force}
            reply = self._call("DELETE", "/cache/objects", DeleteObjectsReply, body)
            total = DeleteObjectsReply(
                deleted=total.deleted + reply.deleted,
                skipped=total.skipped + reply.skipped,
                ok=reply.ok,
                error=reply.error,
            )
            if not reply.ok:
                break
        return total

    def submit_prefetch(
        self, model_name: str, world_size: int, token_ids: Sequence[int], cache_salt: str = ""
    ) -> PrefetchSubmitted:
        """``POST /cache/prefetches`` (202): L2 -> L1 of the complete chunks of ``token_ids``."""
        body = {"model_name": model_name, "world_size": world_size,
                "token_ids": list(token_ids), "cache_salt": cache_salt}  # fmt: skip
        return self._call("POST", "/cache/prefetches", PrefetchSubmitted, body, ok=202)

    def prefetch_status(self, request_id: str) -> PrefetchStatusReply | None:
        """``GET /cache/prefetches/{request_id}``; ``None`` when the server does not know it
        (never submitted, or forgotten: LMCache forgets at the first completed poll)."""
        try:
            return self._call(
                "GET", f"/cache/prefetches/{_segment(request_id)}", PrefetchStatusReply
            )
        except MPServerError as exc:
            if exc.reply_status == 404:
                return None
            raise

    def hold(
        self,
        hold_id: str,
        model_name: str,
        world_size: int,
        token_ids: Sequence[int],
        cache_salt: str,
        source_instance_id: str,
        ttl_s: float,
    ) -> HoldReply:
        """``PUT /cache/holds/{hold_id}`` (a kvatlas node, a move's target): load the keys of
        ``token_ids`` into L1 (own L2, else ``source_instance_id``'s L1 or L2) and hold them
        for ``ttl_s``. An LMCache server has no such route (404: it cannot be a target)."""
        body = {"model_name": model_name, "world_size": world_size,
                "token_ids": list(token_ids), "cache_salt": cache_salt,
                "source_instance_id": source_instance_id, "ttl_s": ttl_s}  # fmt: skip
        return self._call("PUT", f"/cache/holds/{_segment(hold_id)}", HoldReply, body)

    def release(self, hold_id: str) -> ReleaseReply:
        """``DELETE /cache/holds/{hold_id}``: the move's keys are the target's LRU's again."""
        return self._call("DELETE", f"/cache/holds/{_segment(hold_id)}", ReleaseReply)

    def list_objects(
        self, *, page_size: int = 500, page_token: str | None = None, model_name: str | None = None
    ) -> ObjectPage:
        """``GET /cache/objects``: one page of the L2 backend's keys (503: it cannot list)."""
        params: dict[str, Any] = {"page_size": page_size}
        if page_token is not None:
            params["page_token"] = page_token
        if model_name is not None:
            params["model_name"] = model_name
        return self._call("GET", "/cache/objects", ObjectPage, params=params)

    def clear(self, *, force: bool = False) -> ClearReply:
        """``POST /cache/clear``: empty the server's L1."""
        return self._call("POST", "/cache/clear", ClearReply, {"tier": "l1", "force": force})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MPServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        type_: type[T],
        body: Any = None,
        *,
        ok: int = 200,
        params: dict[str, Any] | None = None,
    ) -> T:
        content = msgspec.json.encode(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else None
        try:
            r = self._http.request(method, path, content=content, headers=headers, params=params)
        except httpx.HTTPError as exc:
            raise MPServerError(f"{method} {self.url}{path}: {exc}", None) from exc
        if r.status_code != ok:
            raise MPServerError(f"{method} {path}: {r.status_code} {r.text[:500]}", r.status_code)
        try:
            return msgspec.json.decode(r.content, type=type_)
        except msgspec.MsgspecError as exc:
            raise MPServerError(
                f"{method} {path}: a reply not of its type: {exc}", r.status_code
            ) from None
