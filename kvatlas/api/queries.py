"""Request bodies the coordinator decodes with msgspec, straight from bytes (no dict, no
pydantic): the blend lookup's and route scoring's. ``/openapi.json`` documents them from these
types (``msgspec.json.schema_components``), so the documentation is the decoder. Semantic
checks that name a limit or a namespace rule (token counts, base64, ``world_size``) stay with
the query that applies them (``coordinator/query.py``): their messages name the flag."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvatlas.api.codec import encode


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
