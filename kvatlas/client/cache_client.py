"""CacheControlClient: the coordinator's cache-control routes (``docs/cache-control.md``) as typed
calls — pins and their listing, delete, prefetch and its status, moves and their status, the
default quota and each salt's quota — and :func:`wait_for_status`, which polls a long command
until it ends.

Replies are decoded as the wire types the coordinator encodes them with
(:mod:`kvatlas.api.cache_control`); a refusal raises
:class:`~kvatlas.client.coordinator_client.CoordinatorError` carrying the coordinator's status
(``reply_status``) and its ``detail`` in the message, as every coordinator client does. In
paths the empty salt is named ``_default`` (LMCache's convention): callers pass the salt
itself, ``""`` included, and this client names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import quote

import httpx

from kvatlas.api import encode
from kvatlas.api.cache_control import (
    DEFAULT_SALT_NAME,
    CoordinatorDeleteBody,
    CoordinatorDeleteReply,
    CoordinatorPrefetchBody,
    CoordinatorPrefetchReply,
    CoordinatorPrefetchStatus,
    MoveBody,
    MoveReply,
    MoveStatus,
    PinReply,
    PinsReply,
    QuotaConfig,
    QuotaList,
    QuotaSetBody,
    QuotaSetReply,
    QuotaStatus,
    TierName,
    TokenFields,
)
from kvatlas.client.coordinator_client import JSON_HEADERS, auth_headers, call_json

T = TypeVar("T")


def salt_segment(cache_salt: str) -> str:
    """A salt as a path segment or query value: ``_default`` for the empty one, quoted."""
    return quote(cache_salt, safe="") if cache_salt else DEFAULT_SALT_NAME


class CacheControlClient:
    """One coordinator's cache-control routes; one persistent connection (``token``: an
    ``admin`` token, or a ``cache`` token bound to the salts it acts on)."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=auth_headers(token))

    def _call(self, method: str, path: str, reply: type[T], body: object = None) -> T:
        if body is None:
            result: T = call_json(self._http, method, path, reply)
        else:
            sent = {"content": encode(body), "headers": JSON_HEADERS}
            result = call_json(self._http, method, path, reply, **sent)
        return result

    # ------------------------------------------------------------------ pins

    def pin(self, fields: TokenFields) -> PinReply:
        """One more pin on each key of ``fields``' complete chunks."""
        return self._call("POST", "/cache/pins", PinReply, fields)

    def unpin(self, fields: TokenFields) -> PinReply:
        """One pin fewer on each (floored at 0)."""
        return self._call("DELETE", "/cache/pins", PinReply, fields)

    def pins(
        self,
        cache_salt: str | None = None,
        model_name: str = "",
        offset: int = 0,
        limit: int = 1000,
    ) -> PinsReply:
        """A page of pinned keys, first pinned first: ``cache_salt`` ``None`` lists every
        salt's (a token bound to salts may not), ``""`` the empty salt's."""
        params: dict[str, str | int] = {"offset": offset, "limit": limit}
        if cache_salt is not None:
            params["cache_salt"] = cache_salt or DEFAULT_SALT_NAME
        if model_name:
            params["model_name"] = model_name
        path = httpx.URL("/cache/pins", params=params)
        return self._call("GET", str(path), PinsReply)

    # ------------------------------------------------------------------ delete, prefetch

    def delete(
        self, instance_id: str, fields: TokenFields, tier: TierName = "all", *, force: bool = False
    ) -> CoordinatorDeleteReply:
        """Delete the keys of ``fields`` from ``instance_id``'s ``tier`` (a durable command:
        a 502 means it was recorded and will be retried while the instance is down)."""
        f = fields
        body = CoordinatorDeleteBody(
            model_name=f.model_name, world_size=f.world_size, token_ids=f.token_ids,
            cache_salt=f.cache_salt, instance_id=instance_id, tier=tier, force=force,
        )  # fmt: skip
        return self._call("POST", "/cache/delete", CoordinatorDeleteReply, body)

    def prefetch(self, instance_id: str, fields: TokenFields) -> CoordinatorPrefetchReply:
        """Load the keys of ``fields`` from ``instance_id``'s L2 into its L1."""
        f = fields
        body = CoordinatorPrefetchBody(
            model_name=f.model_name, world_size=f.world_size, token_ids=f.token_ids,
            cache_salt=f.cache_salt, instance_id=instance_id,
        )  # fmt: skip
        return self._call("POST", "/cache/prefetches", CoordinatorPrefetchReply, body)

    def prefetch_status(self, instance_id: str, request_id: str) -> CoordinatorPrefetchStatus:
        path = f"/cache/prefetches/{quote(instance_id, safe='')}/{quote(request_id, safe='')}"
        return self._call("GET", path, CoordinatorPrefetchStatus)

    # ------------------------------------------------------------------ moves

    def move(
        self, source: str, target: str, fields: TokenFields, *, keep_source: bool = False
    ) -> MoveReply:
        """Move the keys of ``fields`` from ``source``'s L1 to ``target``'s (``keep_source``:
        a copy)."""
        f = fields
        body = MoveBody(
            model_name=f.model_name, world_size=f.world_size, token_ids=f.token_ids,
            cache_salt=f.cache_salt, source_instance_id=source, target_instance_id=target,
            keep_source=keep_source,
        )  # fmt: skip
        return self._call("POST", "/cache/moves", MoveReply, body)

    def move_status(self, move_id: str) -> MoveStatus:
        return self._call("GET", f"/cache/moves/{quote(move_id, safe='')}", MoveStatus)

    # ------------------------------------------------------------------ quotas

    def quota_config(self) -> QuotaConfig:
        return self._call("GET", "/quota/config", QuotaConfig)

    def set_quota_config(self, default_limit_gb: float | None) -> QuotaConfig:
        """The default quota: ``None`` = salts without their own are exempt."""
        return self._call("PUT", "/quota/config", QuotaConfig, QuotaConfig(default_limit_gb))

    def quota(self, cache_salt: str) -> QuotaStatus:
        return self._call("GET", f"/quota/{salt_segment(cache_salt)}", QuotaStatus)

    def set_quota(self, cache_salt: str, limit_gb: float) -> QuotaSetReply:
        path = f"/quota/{salt_segment(cache_salt)}"
        return self._call("PUT", path, QuotaSetReply, QuotaSetBody(limit_gb))

    def remove_quota(self, cache_salt: str) -> QuotaSetReply:
        return self._call("DELETE", f"/quota/{salt_segment(cache_salt)}", QuotaSetReply)

    def quotas(self) -> QuotaList:
        """Every salt with a quota or usage (a token bound to salts may not)."""
        return self._call("GET", "/quota", QuotaList)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CacheControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_fields(
    model_name: str, token_ids: Sequence[int], *, world_size: int = 1, cache_salt: str = ""
) -> TokenFields:
    """What a request resolves to keys with the coordinator's hashing."""
    return TokenFields(
        model_name=model_name, world_size=world_size, token_ids=list(token_ids),
        cache_salt=cache_salt,
    )  # fmt: skip


def wait_for_status(
    poll: Callable[[], T],
    finished: Callable[[T], bool],
    *,
    timeout_s: float,
    interval_s: float = 1.0,
    on_status: Callable[[T, float], object] = lambda status, elapsed_s: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> tuple[T, bool]:
    """Poll until ``finished(status)`` or ``timeout_s`` passed: ``(last status, finished)``.
    ``on_status(status, elapsed_s)`` sees every status polled (progress); a refusal raises
    the client's error at once (a 404 does not turn into waiting forever)."""
    start = clock()
    while True:
        status = poll()
        elapsed = clock() - start
        on_status(status, elapsed)
        if finished(status):
            return status, True
        if elapsed >= timeout_s:
            return status, False
        sleep(min(interval_s, max(timeout_s - elapsed, 0.0)))
