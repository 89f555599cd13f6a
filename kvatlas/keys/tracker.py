"""RequestTracker: the single point where a request's tokens become key material.

Identity is substituted into the placeholder spans once, when the request enters, and every
key-carrying path (lookup, store, retrieve, lock/unlock, prefetch, blend lookup) takes its
token ids from :meth:`RequestTracker.get_token_ids`. A path that hashed the engine's raw prompt
instead would key "text + image 1" and "text + image 2" identically: silent wrong KV.

The multimodal bypass guard lives here too: a request whose multimodal items have no usable
identity is made uncacheable (no keys at all), logged and counted.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvatlas.keys.adapters import extract_request
from kvatlas.keys.extra_keys import MMItem
from kvatlas.keys.mm_substitution import apply_mm_hashes_to_token_ids
from kvatlas.keys.namespace import BlendNamespace
from kvatlas.keys.object_key import ObjectKey, expand_prefix_keys
from kvatlas.keys.scheme import KeyScheme
from kvatlas.keys.tokens import TokenArray, as_token_array

log = logging.getLogger(__name__)


class BypassGuard:
    """Counts requests refused a cache key, by reason (exported as a metric by services)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reasons: Counter[str] = Counter()

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self.reasons.values())

    def refuse(self, request_id: str, reason: str) -> None:
        kind = reason.split(":", 1)[0]
        with self._lock:
            self.reasons[kind] += 1
        log.warning(
            "request %s is uncacheable (no lookup, no store): %s", request_id or "?", reason
        )


MM_BYPASS_GUARD = BypassGuard()


def _span_problems(items: Sequence[MMItem], prompt_len: int) -> list[str]:
    """Why these items cannot be keyed; each reason starts with a stable kind (the counter key).

    An empty span (length 0) writes nothing into the tokens, so "cat" and "dog" there would
    key alike; a span not inside ``[0, prompt_len)`` was written for another prompt.
    """
    problems = [f"empty identifier: item at {it.span.offset}" for it in items if not it.identifier]
    ordered = sorted(items, key=lambda item: item.span.offset)
    for item in ordered:
        if item.span.length == 0:
            problems.append(
                f"empty placeholder span: {item.identifier!r} at {item.span.offset} has length 0"
            )
        elif item.span.end > prompt_len:
            problems.append(
                f"placeholder span outside the prompt: [{item.span.offset}, {item.span.end}) "
                f"of {item.identifier!r} does not fit the {prompt_len}-token prompt"
            )
    for left, right in itertools.pairwise(ordered):
        if right.span.offset < left.span.end:
            problems.append(
                f"overlapping placeholder spans: {left.identifier!r} and {right.identifier!r}"
            )
    return problems


class RequestTracker:
    """One per request: adjusted prompt + generated tokens, and every key derived from them."""

    def __init__(
        self,
        prompt_token_ids: Any,
        items: Sequence[MMItem] = (),
        *,
        scheme: KeyScheme | None = None,
        request_keys: Mapping[str, str | int] | None = None,
        request_id: str = "",
        cache_salt: str = "",
        problems: Sequence[str] = (),
        guard: BypassGuard = MM_BYPASS_GUARD,
    ) -> None:
        self.scheme = scheme or KeyScheme()
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.items = tuple(items)
        self.request_keys = dict(request_keys or {})
        prompt = as_token_array(prompt_token_ids).astype(np.int64)
        issues = list(problems) + _span_problems(self.items, len(prompt))
        if self.request_keys and not self.scheme.carries_extra_keys:
            issues.append(f"request keys need blake3-x1: {sorted(self.request_keys)}")
        self.uncacheable_reason: str | None = "; ".join(issues) if issues else None
        if self.uncacheable_reason is not None:
            guard.refuse(request_id, self.uncacheable_reason)
        elif self.items:
            apply_mm_hashes_to_token_ids(
                prompt, [it.identifier for it in self.items], [it.span for it in self.items]
            )
        self._prompt_len = len(prompt)
        self._tokens: TokenArray = prompt.astype(np.uint32)  # adjusted prompt + generated
        self._tokens.setflags(write=False)
        extra = self.request_keys if self.scheme.carries_extra_keys else None
        self._chain = self.scheme.new_chain(self.items, extra)
        self._chain_lock = threading.Lock()

    @classmethod
    def from_request(
        cls,
        request: Any,
        *,
        scheme: KeyScheme | None = None,
        engine: str | None = None,
        guard: BypassGuard = MM_BYPASS_GUARD,
    ) -> RequestTracker:
        """Build from a vLLM/SGLang/TensorRT-LLM-shaped request (duck-typed)."""
        view = extract_request(request, engine)
        scheme = scheme or KeyScheme()
        prompt = view.prompt_token_ids if view.prompt_token_ids is not None else []
        tracker = cls(
            prompt,
            view.items,
            scheme=scheme,
            request_keys=view.request_keys,
            request_id=view.request_id,
            cache_salt=view.cache_salt,
            problems=view.problems,
            guard=guard,
        )
        tracker.append_generated(view.output_token_ids)
        return tracker

    @property
    def cacheable(self) -> bool:
        return self.uncacheable_reason is None

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    def append_generated(self, token_ids: Iterable[int]) -> None:
        """Generated tokens are appended untouched (they carry no placeholders)."""
        new = as_token_array(list(token_ids))
        if len(new):
            self._tokens = np.concatenate([self._tokens, new])
            self._tokens.setflags(write=False)

    def get_token_ids(self) -> TokenArray:
        """The adjusted prompt followed by generated tokens: the only token source for keys."""
        return self._tokens

    def chunk_hashes(self, num_tokens: int | None = None) -> list[bytes]:
        """Chain hashes of the full chunks of the first ``num_tokens`` tokens ([] if uncacheable)."""
        if not self.cacheable:
            return []
        tokens = self.get_token_ids()
        if num_tokens is not None:
            tokens = tokens[:num_tokens]
        with self._chain_lock:
            return self._chain.update(tokens)

    def prefix_keys(
        self,
        model_name: str,
        world_size: int = 1,
        *,
        object_group_id: int = 0,
        num_tokens: int | None = None,
    ) -> list[ObjectKey]:
        """Keys a prefix lookup asks for, chunk-major and rank-minor ([] if uncacheable)."""
        return expand_prefix_keys(
            self.chunk_hashes(num_tokens), model_name, world_size, self.cache_salt, object_group_id
        )

    def blend_namespace(self, model_name: str, world_size: int = 1) -> BlendNamespace:
        return BlendNamespace(model_name, self.cache_salt, world_size)
