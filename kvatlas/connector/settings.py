"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once at start-up.

Unknown keys are refused (a typo such as ``"blnd": true`` would otherwise silently run
without the feature it names). The engine token never travels in the JSON config (it would
show in the process list): it comes from ``token_file`` (mode 600) or ``KVATLAS_ENGINE_TOKEN``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx

from kvatlas.auth import read_secret_file
from kvatlas.errors import InvalidInput
from kvatlas.keys import check_model_name

KV_PACKINGS: Final = ("split_last", "split_tokens")
"""How a backend packs K and V in one page cell ``[B, H, N, C]`` (``C`` = K dims + V dims):
``split_last``: a token's K then its V on the last axis (FlashAttention, FlexAttention);
``split_tokens``: per (block, head), the block's K rows then its V rows (vLLM's CPU backend)."""
BACKEND_PACKINGS: Final = {
    "FLASH_ATTN": "split_last",
    "FLEX_ATTENTION": "split_last",
    "CPU_ATTN": "split_tokens",
}


def backend_packing(setting: str | None, backends: Collection[str]) -> str:
    """The K/V packing of a cache whose attention layers run ``backends`` (vLLM's backend
    names): ``kv_packing`` (``setting``) when set, unless a backend of known packing
    (:data:`BACKEND_PACKINGS`) packs otherwise (stored chunks would be wrong KV for every
    other engine); unset, the backends' one known packing. Refused otherwise, naming them."""
    names = sorted(set(backends))
    if setting is not None:
        other = {
            n: BACKEND_PACKINGS[n] for n in names if BACKEND_PACKINGS.get(n, setting) != setting
        }
        if other:
            raise InvalidInput(
                f"kv_connector_extra_config.kv_packing is {setting!r}, but the attention "
                f"backends {other} pack K and V otherwise: remove kv_packing (the backend's is "
                "known) or correct it (docs/vllm.md)"
            )
        return setting
    packings = {BACKEND_PACKINGS.get(n) for n in names}
    if len(packings) != 1 or None in packings:
        raise InvalidInput(
            f"kvatlas connector: attention backends {names}: no known K/V packing; set "
            f"kv_connector_extra_config.kv_packing to one of {KV_PACKINGS} (docs/vllm.md)"
        )
    return str(packings.pop())


TOKEN_ENV: Final = "KVATLAS_ENGINE_TOKEN"
_KEYS: Final = (
    "node_url", "token_file", "model_name", "blend", "kv_packing", "timeout_s",
    "lookup_timeout_s", "retry_s",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """``node_url``: the node's engine API; ``token``: its engine token (``None``: no auth);
    ``model_name``: the node's ``--model-name`` this engine's KV is keyed under (``None``:
    vLLM's served model name or model, :func:`kvatlas.connector.check_model`); ``blend``:
    reuse fragments after the prefix (re-RoPE'd; see docs/vllm.md for what that changes);
    ``kv_packing``: ``None`` = from the attention backend; ``timeout_s``: one node call of the
    worker (KV moves); ``lookup_timeout_s``: one call of the scheduler (vLLM's scheduler,
    every request, waits on it); ``retry_s``: how long an unreachable node is left alone
    before the next attempt."""

    node_url: str
    token: str | None = None
    blend: bool = False
    kv_packing: str | None = None
    timeout_s: float = 30.0
    retry_s: float = 5.0
    lookup_timeout_s: float = 2.0
    model_name: str | None = None

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object], environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        env = os.environ if environ is None else environ
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise InvalidInput(
                f"kv_connector_extra_config: unknown keys {unknown} (known: {list(_KEYS)})"
            )
        url = _node_url(extra.get("node_url"))
        blend = extra.get("blend", False)
        if not isinstance(blend, bool):
            raise InvalidInput(
                f"kv_connector_extra_config.blend must be true or false, got {blend!r}"
            )
        packing = extra.get("kv_packing")
        if packing is not None and packing not in KV_PACKINGS:
            raise InvalidInput(
                f"kv_connector_extra_config.kv_packing must be one of {KV_PACKINGS}, got {packing!r}"
            )
        numbers = {}
        for name in ("timeout_s", "retry_s", "lookup_timeout_s"):
            value = extra.get(name, cls.__dataclass_fields__[name].default)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value <= 3600
            ):
                raise InvalidInput(
                    f"kv_connector_extra_config.{name} must be seconds in (0, 3600], got {value!r}"
                )
            numbers[name] = float(value)
        token_file = extra.get("token_file")
        if token_file is not None and not isinstance(token_file, str):
            raise InvalidInput(
                f"kv_connector_extra_config.token_file must be a path, got {token_file!r}"
            )
        token = _read_token(Path(token_file)) if token_file else env.get(TOKEN_ENV) or None
        model_name = _model_name(extra.get("model_name"))
        return cls(url.rstrip("/"), token, blend, packing, **numbers, model_name=model_name)


def _node_url(value: object) -> str:
    """The ``node_url`` key: an http(s) URL with a host that httpx can parse (a bracket left
    open or a port that is no number would otherwise escape at the first call as httpx's bare
    ``InvalidURL``, naming neither the key nor the URL)."""
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        try:
            if httpx.URL(value).host:
                return value
        except httpx.InvalidURL:
            pass
    raise InvalidInput(
        f"kv_connector_extra_config.node_url must be the node's http(s) URL, got {value!r}"
    )


def _model_name(value: object) -> str | None:
    """The ``model_name`` key (``None``: not set), by the keys' rule for a model name."""
    if value is None:
        return None
    try:
        return check_model_name(value)  # type: ignore[arg-type]  # checks the type too
    except ValueError as exc:
        raise InvalidInput(
            f"kv_connector_extra_config.model_name must be the node's --model-name ({exc}), "
            f"got {value!r}"
        ) from None


def _read_token(path: Path) -> str:
    """The token in ``path``, by the services' one rule (:func:`kvatlas.auth.read_secret_file`:
    private to its owner, long enough)."""
    try:
        return read_secret_file(path, "kv_connector_extra_config.token_file")
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
