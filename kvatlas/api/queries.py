"""Request bodies and query parameters of the coordinator's routes, decoded with msgspec
straight from bytes (no dict, no model in between). ``/openapi.json`` documents them from these
types (``msgspec.json.schema_components``), so the documentation is the decoder. Semantic
checks that name a limit or a namespace rule (token counts, base64, ``world_size``) stay with
the query that applies them (``coordinator/query.py``): their messages name the flag. Field
names follow LMCache's coordinator; unknown fields are ignored (be liberal in what you accept).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from kvatlas.api.codec import encode
from kvatlas.api.directory import KeyRow
from kvatlas.api.route import TIER_NAMES


class BlendLookupBody(msgspec.Struct):
    """The hot path's body: decoded by msgspec straight from bytes (no dict, no pydantic)."""

    tokens_b64: Annotated[
        str | None,
        msgspec.Meta(description="base64 of the query token ids as little-endian uint32"),
    ] = None
    token_ids: Annotated[
        list[int] | None, msgspec.Meta(description="alternative to tokens_b64")
    ] = None
    model_name: str | None = None
    world_size: int = 1
    cache_salt: str = ""

    def to_json(self) -> bytes:
        """The body as a client sends it: absent (``None``) fields left out, so a blend lookup
        is byte for byte what LMCache's ``BlendCoordinatorClient`` sends."""
        fields = self.__struct_fields__
        return encode({f: v for f in fields if (v := getattr(self, f)) is not None})


class RouteScoreBody(BlendLookupBody):
    """``POST /route/score``: a blend-lookup body, plus whom to score and how."""

    instances: Annotated[
        list[str] | None,
        msgspec.Meta(description="instance ids to score (default: every live instance)"),
    ] = None
    weights: Annotated[
        dict[str, float] | None,
        msgspec.Meta(description="tier weights to override: gpu, l1, l2, peer"),
    ] = None


class RouteScorePacked(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /route/score`` in msgpack (``Content-Type: application/msgpack``): the JSON
    body's fields, with the query's token ids as ``tokens``, little-endian uint32 bytes (the
    engine API's form of a prompt: no base64, no list of integers). An unknown field (the
    JSON body's ``token_ids``, a misspelling) is refused, never scored as an empty query. ``instances`` (an array of
    strings, or nil) stays raw until its length was read from its header
    (``coordinator/route_score.py``): a long list is refused before a string of it exists."""

    tokens: bytes = b""
    model_name: str | None = None
    world_size: int = 1
    cache_salt: str = ""
    instances: msgspec.Raw = msgspec.Raw()
    weights: Annotated[dict[str, float], msgspec.Meta(max_length=len(TIER_NAMES))] | None = None
    """At most one entry per tier (refused before a larger map is read)."""


class LookupRequest(msgspec.Struct):
    """``POST /directory/lookup``: exactly one form, ``keys``, or ``token_ids`` (or
    ``tokens_b64``) with ``model_name``. Strict, as the blend lookup's body: ``"12"`` is not a
    token id. Decoded after its size was read from its bytes (``coordinator/query.py``)."""

    keys: list[KeyRow] | None = None
    token_ids: list[int] | None = None
    tokens_b64: str | None = None
    model_name: str | None = None
    world_size: int = 1
    cache_salt: str = ""
    object_group_id: int = 0


class RegisterRequest(msgspec.Struct):
    """``POST /instances``. LMCache's defaults mean "absent": ``instance_id: ""`` (the
    coordinator assigns one), ``p2p_advertised_url: ""``, ``mq_port: 0``, ``chunk_size: null``.
    Lax, as LMCache reads it: ``"8000"`` is a port, ``" b "`` the id ``b``."""

    LAX_NUMBERS: ClassVar[bool] = True
    """Numbers in strings and integral floats are integers here (``kvatlas.fields``); every
    other request body is strict."""

    instance_id: str | None = None
    ip: str = ""
    http_port: int | None = None
    metadata: dict[str, Any] = {}
    p2p_advertised_url: str | None = None
    mq_port: int | None = None
    chunk_size: Annotated[
        int | None, msgspec.Meta(description="the instance's chunk size (409 if not ours)")
    ] = None
    p2p_url_signature: Annotated[
        str | None,
        msgspec.Meta(
            description="kvatlas nodes: their peer secret's signature of id and URL (hex)"
        ),
    ] = None
    engine_id: Annotated[
        str | None,
        msgspec.Meta(
            description="kvatlas nodes: the engine whose KV connector this node is (its copies "
            "count as that engine's own in POST /route/score)"
        ),
    ] = None

    def __post_init__(self) -> None:
        # LMCache strips these (pydantic ``strip_whitespace``): " b " registers "b", a blank
        # id is assigned one
        if self.instance_id is not None:
            self.instance_id = self.instance_id.strip()
        self.ip = self.ip.strip()
        if self.p2p_advertised_url is not None:
            self.p2p_advertised_url = self.p2p_advertised_url.strip()


class ChunkSizeRequest(msgspec.Struct):
    """``PUT /config/chunk-size`` (LMCache 0.5.7): the chunk size an instance runs with."""

    chunk_size: int


class KeyListingQuery(msgspec.Struct):
    """``GET /directory/keys``'s query parameters: filters, then a page by ``cursor`` (or by
    ``offset``) of at most ``limit`` keys."""

    tier: str | None = None
    instance_id: str | None = None
    backend: str | None = None
    offset: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    cursor: str | None = None


class BlendLookupQuery(msgspec.Struct):
    """``POST /directory/blend-lookup``'s query parameter."""

    with_placements: Annotated[
        bool,
        msgspec.Meta(description="true: each match lists the instances holding it (`placements`)"),
    ] = False
