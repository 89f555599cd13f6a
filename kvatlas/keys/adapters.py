"""Read (prompt, generated tokens, multimodal items, request-level keys) from engine requests.

Written against duck-typed objects shaped like vLLM, SGLang and TensorRT-LLM requests, so no
engine is a dependency. Keys never depend on an engine's own block hashes or block size.
Anything that makes identity unusable is collected in ``problems`` (each starting with a stable
reason, the bypass guard's counter key); the tracker then refuses to key the request (the
multimodal bypass guard) instead of keying it by placeholders alone, and also refuses spans
that are empty or do not fit the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvatlas.keys.extra_keys import MMItem
from kvatlas.keys.mm_substitution import as_span

ENGINES = ("vllm", "sglang", "trtllm")


@dataclass
class EngineRequestView:
    """What the keys layer needs from one engine request."""

    prompt_token_ids: Any
    output_token_ids: Any = ()
    items: list[MMItem] = field(default_factory=list)
    request_keys: dict[str, str | int] = field(default_factory=dict)
    cache_salt: str = ""
    request_id: str = ""
    has_multimodal: bool = False
    problems: list[str] = field(default_factory=list)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _usable_identifier(value: Any) -> bool:
    return value is not None and str(value) != ""


def _add_item(view: EngineRequestView, identifier: Any, position: Any, what: str) -> None:
    view.has_multimodal = True
    if not _usable_identifier(identifier):
        view.problems.append(f"missing identifier: {what}")
        return
    try:
        span = as_span(position)
    except (ValueError, KeyError, TypeError) as exc:
        view.problems.append(f"unusable placeholder position: {what} ({exc})")
        return
    view.items.append(MMItem(str(identifier), span))


def detect_engine(request: Any) -> str:
    if _get(request, "origin_input_ids") is not None:
        return "sglang"
    if _get(request, "multimodal_hashes") is not None or _get(request, "multimodal_positions"):
        return "trtllm"
    if any(_get(request, n) is not None for n in ("lora_task_id", "py_request_id")) or (
        _get(request, "prompt_token_ids") is None and callable(getattr(request, "get_tokens", None))
    ):
        return "trtllm"
    return "vllm"


def extract_request(request: Any, engine: str | None = None) -> EngineRequestView:
    engine = engine or detect_engine(request)
    if engine == "vllm":
        return extract_vllm(request)
    if engine == "sglang":
        return extract_sglang(request)
    if engine == "trtllm":
        return extract_trtllm(request)
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def extract_vllm(request: Any) -> EngineRequestView:
    """vLLM: ``mm_features[i].identifier`` / ``.mm_position``, or legacy ``mm_hashes``/``mm_positions``."""
    view = EngineRequestView(
        prompt_token_ids=_get(request, "prompt_token_ids"),
        output_token_ids=_get(request, "output_token_ids") or (),
        cache_salt=_get(request, "cache_salt") or "",
        request_id=str(_get(request, "request_id", "") or ""),
    )
    features = _get(request, "mm_features") or ()
    for i, feature in enumerate(features):
        _add_item(
            view, _get(feature, "identifier"), _get(feature, "mm_position"), f"mm_features[{i}]"
        )
    if not features:
        hashes: Sequence[Any] = _get(request, "mm_hashes") or ()
        positions: Sequence[Any] = _get(request, "mm_positions") or ()
        for i, position in enumerate(positions):
            identifier = hashes[i] if i < len(hashes) else None
            _add_item(view, identifier, position, f"mm_positions[{i}]")
        if len(hashes) > len(positions):
            view.has_multimodal = True
            view.problems.append(
                "unusable placeholder position: mm_hashes without matching mm_positions"
            )
    lora = _get(request, "lora_request")
    if lora is not None:
        name = _get(lora, "lora_name") or _get(lora, "name")
        view.request_keys["lora"] = str(name) if name else int(_get(lora, "lora_int_id", 0))
    if view.prompt_token_ids is None:
        view.problems.append("no prompt token ids: prompt embeddings have no token identity")
    return view


def extract_sglang(req: Any) -> EngineRequestView:
    """SGLang: ``multimodal_inputs.mm_items[i].hash`` with inclusive ``(start, end)`` offsets."""
    view = EngineRequestView(
        prompt_token_ids=_get(req, "origin_input_ids"),
        output_token_ids=_get(req, "output_ids") or (),
        request_id=str(_get(req, "rid", "") or ""),
    )
    mm_inputs = _get(req, "multimodal_inputs")
    items = (_get(mm_inputs, "mm_items") or ()) if mm_inputs is not None else ()
    for i, item in enumerate(items):
        offsets = _get(item, "offsets")
        identifier = _get(item, "hash")
        if not offsets:
            view.has_multimodal = True
            view.problems.append(f"unusable placeholder position: mm_items[{i}] has no offsets")
            continue
        for k, pair in enumerate(offsets):
            try:
                start, end_inclusive = int(pair[0]), int(pair[1])
            except (TypeError, ValueError, IndexError):
                view.has_multimodal = True
                view.problems.append(
                    f"unusable placeholder position: mm_items[{i}].offsets[{k}] is not a (start, end) pair"
                )
                continue
            # One item may hold several images under one hash: number the ranges so each
            # range gets its own values (the item hash already covers the whole set).
            ident = identifier if len(offsets) == 1 or identifier is None else f"{identifier}#{k}"
            _add_item(
                view, ident, (start, end_inclusive - start + 1), f"mm_items[{i}].offsets[{k}]"
            )
    lora = _get(req, "lora_id") or _get(req, "lora_path")
    if lora:
        view.request_keys["lora"] = str(lora)
    return view


def trtllm_hash_identifier(words: Any) -> str:
    """TensorRT-LLM carries a 256-bit hash as eight (possibly negative) int32 words."""
    if isinstance(words, (str, bytes)):
        return words if isinstance(words, str) else words.hex()
    values = [int(w) & 0xFFFFFFFF for w in words]
    if len(values) != 8:
        raise ValueError(f"expected 8 hash words, got {len(values)}")
    return "".join(f"{v:08x}" for v in values)


def extract_trtllm(request: Any) -> EngineRequestView:
    """TensorRT-LLM: ``multimodal_hashes`` / ``multimodal_positions`` / ``multimodal_lengths``."""
    prompt = _get(request, "prompt_token_ids")
    generated = _get(request, "output_token_ids") or ()
    if prompt is None and callable(getattr(request, "get_tokens", None)):
        # get_tokens(beam) is prompt + generated; prompt_len says where the prompt ends.
        everything = list(request.get_tokens(0))
        cut = _get(request, "prompt_len") or _get(request, "orig_prompt_len") or len(everything)
        prompt, generated = everything[:cut], everything[cut:]
    view = EngineRequestView(
        prompt_token_ids=prompt,
        output_token_ids=generated,
        request_id=str(_get(request, "request_id", "") or _get(request, "py_request_id", "") or ""),
    )
    hashes = _get(request, "multimodal_hashes") or ()
    positions = _get(request, "multimodal_positions") or ()
    lengths = _get(request, "multimodal_lengths") or ()
    for i in range(max(len(hashes), len(positions), len(lengths))):
        what = f"multimodal item {i}"
        if i >= len(positions) or i >= len(lengths):
            view.has_multimodal = True
            view.problems.append(f"unusable placeholder position: {what} has no position or length")
            continue
        identifier = None
        if i < len(hashes) and hashes[i] is not None:
            try:
                identifier = trtllm_hash_identifier(hashes[i])
            except (TypeError, ValueError) as exc:
                view.has_multimodal = True
                view.problems.append(f"missing identifier: {what} has an unusable hash ({exc})")
                continue
        _add_item(view, identifier, (positions[i], lengths[i]), what)
    lora = _get(request, "lora_task_id")
    if lora is not None:
        view.request_keys["lora"] = int(lora)
    return view
