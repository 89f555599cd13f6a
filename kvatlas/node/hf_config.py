"""A node's KV layout read from a Hugging Face ``config.json`` (``kvatlas node --hf-config``).

A wrong layout fails silently: the wrong ``rope_theta`` re-RoPEs every reused chunk to the
wrong position, wrong head counts mis-shape every chunk. So this module reads only what the
file states, refuses what it contradicts (two spellings of one field that disagree) and
what re-RoPE cannot honour (RoPE scaling, per-layer thetas, MLA), and leaves a field it
does not state as ``None`` for an explicit flag to fill: it never falls back to a library
default (transformers' 10000.0 for a missing ``rope_theta`` is exactly such a guess).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final

from kvatlas.checks import is_plain_int
from kvatlas.errors import InvalidInput
from kvatlas.node.kv_dtype import KV_DTYPES
from kvatlas.rope_styles import rope_style_of

_PLAIN_ROPE_TYPES: Final = (None, "default")
_ALIASES: Final = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "hidden_size": ("hidden_size", "n_embd"),
}


class HfConfigError(InvalidInput):
    """``config.json`` lacks, contradicts or states something a node cannot honour."""


@dataclass(frozen=True, slots=True)
class HfLayout:
    """What a ``config.json`` states about the KV layout; ``None``: the file does not say.

    ``num_kv_heads`` is the model's total (a tensor-parallel rank holds a share of them:
    :meth:`kv_heads_per_rank`); ``rotary_dim`` ``None`` is full rotary.
    """

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str | None
    rope_theta: float | None
    rotary_dim: int | None
    rope_style: str | None

    def kv_heads_per_rank(self, world_size: int) -> int:
        """KV heads on one of ``world_size`` tensor-parallel ranks (vLLM's rule: split when
        they divide, one replicated head per rank when the ranks outnumber them)."""
        if self.num_kv_heads % world_size == 0:
            return self.num_kv_heads // world_size
        if world_size % self.num_kv_heads == 0:
            return 1
        raise HfConfigError(
            f"{self.num_kv_heads} KV heads cannot be split over --world-size {world_size}"
        )


def read_hf_config(path: Path) -> HfLayout:
    """:func:`hf_layout` of the JSON file at ``path`` (a ``config.json`` or its directory)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise HfConfigError(f"--hf-config: cannot read {file}: {exc.strerror}") from None
    except ValueError as exc:
        raise HfConfigError(f"--hf-config: {file} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HfConfigError(f"--hf-config: {file} holds no JSON object")
    try:
        return hf_layout(data)
    except HfConfigError as exc:
        raise HfConfigError(f"--hf-config {file}: {exc}") from None


def hf_layout(config: Mapping[str, object]) -> HfLayout:
    """The layout ``config`` (a parsed ``config.json``) states. A multimodal model's
    language model is read from its ``text_config``."""
    text = config.get("text_config")
    if isinstance(text, dict) and _field(config, "num_hidden_layers") is None:
        config = {**config, **text}
    if config.get("kv_lora_rank") is not None:
        raise HfConfigError(
            "an MLA model (kv_lora_rank): its cache holds one latent per token, not K and V "
            "per head; a kvatlas node has no layout for it"
        )
    layers = _positive(config, "num_hidden_layers")
    heads = _positive(config, "num_attention_heads")
    kv_heads = _optional_positive(config, "num_key_value_heads") or heads
    head_dim = _optional_positive(config, "head_dim")
    if head_dim is None:
        hidden = _positive(config, "hidden_size")
        if hidden % heads:
            raise HfConfigError(
                f"no head_dim, and hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    model_type = str(config.get("model_type") or "")
    return HfLayout(
        model_type=model_type,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=_dtype(config),
        rope_theta=_rope_theta(config),
        rotary_dim=_rotary_dim(config, head_dim),
        rope_style=rope_style_of(model_type),
    )  # fmt: skip


def _field(config: Mapping[str, object], name: str) -> object:
    """``name`` under any of its spellings; two spellings that disagree are refused."""
    found = {
        alias: config[alias]
        for alias in _ALIASES.get(name, (name,))
        if config.get(alias) is not None
    }
    if len(set(map(repr, found.values()))) > 1:
        raise HfConfigError(f"contradictory fields: {found}")
    return next(iter(found.values()), None)


def _optional_positive(config: Mapping[str, object], name: str) -> int | None:
    value = _field(config, name)
    if value is None:
        return None
    if not is_plain_int(value) or value <= 0:
        raise HfConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive(config: Mapping[str, object], name: str) -> int:
    value = _optional_positive(config, name)
    if value is None:
        raise HfConfigError(f"no {name}")
    return value


def _dtype(config: Mapping[str, object]) -> str | None:
    stated = {k: config[k] for k in ("torch_dtype", "dtype") if config.get(k) is not None}
    if len(set(stated.values())) > 1:
        raise HfConfigError(f"contradictory fields: {stated}")
    if not stated:
        return None
    value = next(iter(stated.values()))
    if value not in KV_DTYPES:
        raise HfConfigError(f"dtype {value!r} is not a KV dtype a node holds ({KV_DTYPES})")
    return str(value)


def _rope_theta(config: Mapping[str, object]) -> float | None:
    """The one RoPE base every layer uses, from ``rope_theta``, ``rope_scaling`` or
    ``rope_parameters`` (flat, or one entry per layer type); scaled RoPE is refused."""
    thetas: dict[str, object] = {}
    if config.get("rope_theta") is not None:
        thetas["rope_theta"] = config["rope_theta"]
    for name in ("rope_scaling", "rope_parameters"):
        block = config.get(name)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise HfConfigError(f"{name} must be an object, got {block!r}")
        per_type = all(isinstance(v, dict) for v in block.values()) and block
        for where, params in block.items() if per_type else [(name, block)]:
            assert isinstance(params, dict)
            rope_type = params.get("rope_type", params.get("type"))
            if rope_type not in _PLAIN_ROPE_TYPES:
                raise HfConfigError(
                    f"{where}: rope_type {rope_type!r} rescales the RoPE frequencies; "
                    "kvatlas re-RoPEs plain RoPE only"
                )
            if params.get("rope_theta") is not None:
                thetas[f"{name}.{where}" if per_type else name] = params["rope_theta"]
    values = set()
    for where, theta in thetas.items():
        if isinstance(theta, bool) or not isinstance(theta, int | float):
            raise HfConfigError(f"{where} must be a number, got {theta!r}")
        if not math.isfinite(theta) or theta <= 1.0:
            raise HfConfigError(f"{where} must be a finite number > 1, got {theta!r}")
        values.add(float(theta))
    if len(values) > 1:
        raise HfConfigError(f"contradictory RoPE bases: {thetas}")
    return values.pop() if values else None


def _rotary_dim(config: Mapping[str, object], head_dim: int) -> int | None:
    """Partial rotary: ``rotary_dim`` (dims), ``partial_rotary_factor`` or ``rotary_pct``
    (fractions of ``head_dim``); ``None`` when the file states none (full rotary)."""
    dims: dict[str, float] = {}
    if config.get("rotary_dim") is not None:
        dims["rotary_dim"] = _number(config, "rotary_dim")
    for name in ("partial_rotary_factor", "rotary_pct"):
        if config.get(name) is not None:
            dims[name] = _number(config, name) * head_dim
    if not dims:
        return None
    if len(set(dims.values())) > 1:
        raise HfConfigError(f"contradictory rotary dims (head_dim {head_dim}): {dims}")
    dim = next(iter(dims.values()))
    if dim != int(dim) or not 0 < dim <= head_dim or int(dim) % 2:
        raise HfConfigError(f"rotary dims {dims} are not an even count <= head_dim {head_dim}")
    return None if int(dim) == head_dim else int(dim)


def _number(config: Mapping[str, object], name: str) -> float:
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HfConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


# ------------------------------------------------------------------ flags and file


LAYOUT_DEFAULTS: Final[Mapping[str, object]] = MappingProxyType({
    "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16",
    "rope_style": "neox", "rotary_dim": 0, "rope_theta": 10000.0,
})  # fmt: skip
"""The layout of a node given neither layout flags nor ``--hf-config`` (a small test model,
for code that builds a ``NodeConfig``; ``kvatlas node`` refuses to guess the shape)."""
LAYOUT_SHAPE: Final = ("num_layers", "num_kv_heads", "head_dim")
"""What ``kvatlas node`` needs from flags or ``--hf-config`` (it never guesses them)."""


def resolve_layout(
    given: Mapping[str, object], hf_config: Path | None, world_size: int
) -> dict[str, object]:
    """The layout fields' values (:data:`LAYOUT_DEFAULTS`' names): each flag ``given`` (not
    ``None``), else ``--hf-config``'s value, else the default. With ``--hf-config``, a flag
    that contradicts the file is refused, and a field the file does not state must be given
    as a flag (never a default: a wrong layout fails silently)."""
    if hf_config is None:
        return {n: LAYOUT_DEFAULTS[n] if v is None else v for n, v in given.items()}
    hf = read_hf_config(hf_config)
    stated: dict[str, object] = {
        "num_layers": hf.num_layers, "num_kv_heads": hf.kv_heads_per_rank(world_size),
        "head_dim": hf.head_dim, "dtype": hf.dtype, "rope_style": hf.rope_style,
        "rotary_dim": hf.rotary_dim or 0, "rope_theta": hf.rope_theta,
    }  # fmt: skip
    resolved: dict[str, object] = {}
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        if stated[name] is None and value is None:
            raise ValueError(
                f"--hf-config {hf_config} does not state the {name} "
                f"(model_type {hf.model_type!r}); give {flag}"
            )
        if stated[name] is not None and value is not None and value != stated[name]:
            raise ValueError(
                f"{flag} {value} contradicts --hf-config {hf_config}, which gives "
                f"{stated[name]}; drop the flag or fix the file"
            )
        resolved[name] = stated[name] if value is None else value
    return resolved
