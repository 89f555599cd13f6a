"""RouteClient: ask the coordinator which instance should serve a query (``POST /route/score``,
docs/route-scoring.md), and the ``kvatlas route`` command that prints the answer as a table.

Light like every client: httpx and numpy, no directory, no numba. The reply is decoded as its
wire type (:class:`kvatlas.api.RouteScoresReply`: a malformed row is an error, never a
half-read score); failures raise
:class:`~kvatlas.client.coordinator_client.CoordinatorError` as the coordinator client does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypedDict, Unpack

import httpx
import msgspec

from kvatlas.api import (
    TIER_NAMES,
    InstanceRow,
    InstancesReply,
    RouteScoreBody,
    RouteScoresReply,
)
from kvatlas.checks import is_plain_int, uint32_token_bytes
from kvatlas.client.coordinator_client import (
    JSON_HEADERS,
    CoordinatorError,
    auth_headers,
    call_json,
    encode_tokens_b64,
    read_reply,
)
from kvatlas.client.keepalive import KeepAliveClient

MSGPACK: Final = "application/msgpack"
JSON_RETRY_S: Final = 300.0
"""How long :class:`AsyncRouteClient` sends JSON score bodies to a coordinator that refused the
msgpack one (older than it) before it tries msgpack again (the coordinator may have been
upgraded meanwhile)."""
REFUSED_MSGPACK: Final = frozenset({415, 422})
"""What a coordinator that does not take the msgpack body answers it: 415, or 422 (one older
than it reads the body as JSON: ``body: JSON is malformed: invalid character (byte 0)``)."""
log = logging.getLogger(__name__)


class ScoreOptions(TypedDict, total=False):
    """What a query is scored under, beside its tokens and model (sync and async client)."""

    world_size: int
    cache_salt: str
    instances: Sequence[str] | None
    """Instance ids to score (default every live instance)."""
    weights: Mapping[str, float] | None
    """Tier weights to override."""


def score_body(token_ids: Any, model_name: str, **options: Unpack[ScoreOptions]) -> bytes:
    """The ``POST /route/score`` body (one place for the sync and the async client)."""
    instances, weights = options.get("instances"), options.get("weights")
    return RouteScoreBody(
        tokens_b64=encode_tokens_b64(token_ids),
        model_name=model_name,
        world_size=options.get("world_size", 1),
        cache_salt=options.get("cache_salt", ""),
        instances=None if instances is None else list(instances),
        weights=None if weights is None else dict(weights),
    ).to_json()


_msgpack = msgspec.msgpack.Encoder()


def packed_score_body(token_ids: Any, model_name: str, **options: Unpack[ScoreOptions]) -> bytes:
    """The ``POST /route/score`` body in msgpack (:class:`kvatlas.api.RouteScorePacked`: the
    tokens as little-endian uint32 bytes), sent with ``Content-Type: application/msgpack``:
    a 4,096-token query is 16 KB, not 22 KB of base64, and neither side converts it."""
    instances, weights = options.get("instances"), options.get("weights")
    fields: dict[str, Any] = {
        "tokens": uint32_token_bytes(token_ids),
        "model_name": model_name,
        "world_size": options.get("world_size", 1),
        "cache_salt": options.get("cache_salt", ""),
    }
    if instances is not None:
        fields["instances"] = list(instances)
    if weights is not None:
        fields["weights"] = dict(weights)
    return _msgpack.encode(fields)


class RouteClient:
    """``score()`` a query against the fleet; one persistent connection."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=auth_headers(token))

    def score(
        self, token_ids: Any, model_name: str, **options: Unpack[ScoreOptions]
    ) -> RouteScoresReply:
        """Every candidate (``instances``, default every live instance), best first."""
        body = score_body(token_ids, model_name, **options)
        reply: RouteScoresReply = call_json(
            self._http, "POST", "/route/score", RouteScoresReply, content=body, headers=JSON_HEADERS
        )
        return reply

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRouteClient:
    """The same on an event loop (``kvatlas router``), plus the instance listing a router
    learns engines from; failures raise :class:`CoordinatorError` as the sync client does.
    Its score bodies are msgpack (:func:`packed_score_body`; the sync client sends JSON). A
    coordinator that refuses msgpack (:data:`REFUSED_MSGPACK`) while it answers the same query
    in JSON is older than this client: it gets JSON bodies for :data:`JSON_RETRY_S`, then
    msgpack is tried again; the first such fallback is logged as a warning, each one calls
    ``on_json_fallback`` (the router counts them). A refusal of the JSON body too is the
    query's own: raised, nothing remembered.

    It speaks through :class:`~kvatlas.client.keepalive.KeepAliveClient`, not a general
    client: a router scores every request, and aiohttp's client costs about 2.5× its CPU
    per call (httpx's more still: docs/router.md, "The router's own cost")."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 5.0,
        on_json_fallback: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = KeepAliveClient(self.url, auth_headers(token))
        self._timeout = timeout
        self.on_json_fallback = on_json_fallback
        self._clock = clock
        self._json_until = float("-inf")  # until then (clock), score bodies go as JSON
        self._warned = False

    async def _call(
        self,
        method: str,
        path: str,
        reply: Any,
        *,
        body: bytes | None = None,
        timeout: float | None = None,
        content_type: str = "application/json",
    ) -> Any:
        try:
            async with asyncio.timeout(self._timeout if timeout is None else timeout):
                status, raw = await self._http.request(method, path, body, content_type)
        except (OSError, TimeoutError) as exc:
            raise CoordinatorError(f"{method} {path}: {exc!r}") from exc
        return read_reply(method, path, status, raw, reply)

    async def score(
        self,
        token_ids: Any,
        model_name: str,
        *,
        timeout: float | None = None,
        **options: Unpack[ScoreOptions],
    ) -> RouteScoresReply:
        """The query's scores; ``timeout`` bounds the whole call (both bodies when the
        msgpack one is refused)."""
        started = self._clock()
        if started < self._json_until:
            return await self._score_json(token_ids, model_name, timeout, **options)
        body = packed_score_body(token_ids, model_name, **options)
        try:
            reply: RouteScoresReply = await self._call(
                "POST", "/route/score", RouteScoresReply, body=body, timeout=timeout,
                content_type=MSGPACK,
            )  # fmt: skip
            return reply
        except CoordinatorError as exc:
            if exc.reply_status not in REFUSED_MSGPACK:
                raise
            refusal = exc
        left = (self._timeout if timeout is None else timeout) - (self._clock() - started)
        reply = await self._score_json(token_ids, model_name, max(left, 0.0), **options)
        self._json_until = self._clock() + JSON_RETRY_S  # it answered JSON: an older one
        if not self._warned:
            self._warned = True
            log.warning(
                "coordinator %s refused the msgpack score body (%s) and answered the JSON one: "
                "it is older than this router; scoring with JSON bodies (msgpack tried again "
                "every %.0f s). Upgrade the coordinator.", self.url, refusal, JSON_RETRY_S,
            )  # fmt: skip
        else:
            log.debug("coordinator %s still refuses msgpack score bodies", self.url)
        if self.on_json_fallback is not None:
            self.on_json_fallback()
        return reply

    async def _score_json(
        self,
        token_ids: Any,
        model_name: str,
        timeout: float | None,
        **options: Unpack[ScoreOptions],
    ) -> RouteScoresReply:
        """The query scored with the JSON body (:func:`score_body`), as an older coordinator
        takes it."""
        body = score_body(token_ids, model_name, **options)
        reply: RouteScoresReply = await self._call(
            "POST", "/route/score", RouteScoresReply, body=body, timeout=timeout
        )
        return reply

    async def instances(self) -> list[InstanceRow]:
        """``GET /instances`` rows (registration fields, liveness)."""
        reply: InstancesReply = await self._call("GET", "/instances", InstancesReply)
        return reply.instances

    async def aclose(self) -> None:
        self._http.close()


# ---------------------------------------------------------------------------- kvatlas route


@dataclass(frozen=True)
class RouteCommand:
    """``kvatlas route``'s flags (each also ``KVATLAS_<NAME>``)."""

    url: str = "http://127.0.0.1:9300"
    tokens_file: Path | None = None
    model_name: str | None = None
    cache_salt: str = ""
    world_size: int = 1
    instances: str | None = None
    coordinator_token: str | None = None


ROUTE_RENAMED_FLAGS = {"model": "model_name"}
"""``kvatlas route``'s old spellings (they warn, for one release)."""


ROUTE_HELP = {
    "url": "coordinator URL",
    "tokens_file": "the query's token ids: a JSON list, or integers separated by spaces/commas",
    "model_name": "model name the query's KV was computed with (required)",
    "cache_salt": "the query's cache salt (tenant; empty: the unsalted namespace)",
    "world_size": "tensor-parallel world size of the query's KV",
    "instances": "comma-separated instance ids to score (default: every live instance)",
    "coordinator_token": "bearer token with the lookup role",
}


def read_tokens(path: Path) -> list[int]:
    """Token ids from a file: a JSON list, or integers separated by whitespace or commas."""
    text = path.read_bytes()
    try:  # not UTF-8, not JSON, not integers: say which file
        if text.lstrip().startswith(b"["):
            ids = json.loads(text)
        else:
            ids = [int(t) for t in text.decode().replace(",", " ").split()]
    except ValueError as exc:
        raise ValueError(f"{path}: not a list of integer token ids ({exc})") from None
    if not isinstance(ids, list) or not all(is_plain_int(t) for t in ids):
        raise ValueError(f"{path}: not a list of integer token ids")
    return ids


def run_route_command(cmd: RouteCommand) -> int:
    """Score the query of ``--tokens-file`` and print the table (exit 1 on a refusal)."""
    from rich.console import Console  # the table only: not loaded by the client
    from rich.table import Table

    if cmd.tokens_file is None:
        raise ValueError("--tokens-file is required")
    if cmd.model_name is None:  # refused here as the coordinator would (exit 1)
        Console(stderr=True).print("[red]model_name is required: give --model-name[/red]")
        return 1
    tokens = read_tokens(cmd.tokens_file)
    instances = [i for i in (cmd.instances or "").split(",") if i] or None
    with RouteClient(cmd.url, token=cmd.coordinator_token) as client:
        try:
            scores = client.score(
                tokens,
                cmd.model_name,
                world_size=cmd.world_size,
                cache_salt=cmd.cache_salt,
                instances=instances,
            )
        except CoordinatorError as exc:
            Console(stderr=True).print(f"[red]{exc}[/red]")
            return 1
    table = Table(title=f"route scores, {scores.query_tokens} query tokens (best first)")
    for column in ("instance", "score", "prefix", "fragments", *TIER_NAMES):
        table.add_column(column, justify="left" if column == "instance" else "right")
    for row in scores.instances:
        table.add_row(
            row.instance_id,
            f"{row.score:,.1f}",
            str(row.prefix_tokens),
            str(row.fragment_tokens),
            *(str(row.by_tier[name]) for name in TIER_NAMES),
        )
    Console().print(table)
    return 0
