"""vLLM's RoPE against the node's: with blend, the node rotates every fragment with its own.

A fragment reused at another position (``blend: true``) has its K re-RoPE'd by the node, with
the node's ``rope_theta``, ``rotary_dim`` and ``rope_style`` (its flags or ``--hf-config``).
Other values than the model's rotate K to wrong positions, and nothing fails. So with blend
the connector starts only when vLLM's model uses plain RoPE with exactly the node's three
values, read from vLLM's config the way vLLM's ``get_rope`` reads them; what it cannot read for
certain (RoPE scaling, M-RoPE, per-layer RoPE that differs, a model type whose rotary style it
does not know, no model config) refuses blend too: never a guess. Without blend the node
re-RoPEs nothing for this engine: a difference is said (a WARNING), not refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final

from vllm.transformers_utils.config import iter_rope_parameters

from kvatlas.client import EngineLayout
from kvatlas.errors import InvalidInput
from kvatlas.rope_styles import rope_style_of

if TYPE_CHECKING:
    from vllm.config import ModelConfig

log = logging.getLogger(__name__)
GET_ROPE_THETA: Final = 10000.0
"""vLLM's ``get_rope``: the base of a model whose ``rope_parameters`` give no ``rope_theta``."""


@dataclass(frozen=True, slots=True)
class Rope:
    """Plain RoPE: the base, the leading dims of a head it rotates, how it pairs them."""

    rope_theta: float
    rotary_dim: int
    rope_style: str


def vllm_rope(model_config: ModelConfig | None, head_size: int) -> Rope | str:
    """The plain RoPE of vLLM's model (``hf_text_config``, as ``get_rope`` reads its
    ``rope_parameters``), or why it cannot be said."""
    text = getattr(model_config, "hf_text_config", None)
    if text is None:
        return "vLLM's config has no model config (hf_text_config) to read its RoPE from"
    model_type = str(getattr(text, "model_type", "") or "")
    style = rope_style_of(model_type)
    if style is None:
        return (
            f"vLLM's model_type {model_type!r} is not one whose rotary style (GPT-NeoX halves "
            "or GPT-J pairs: vLLM's model code decides it) the connector knows"
        )
    if getattr(text, "dual_chunk_attention_config", None) is not None:
        return "vLLM's model uses dual chunk attention (its own RoPE)"
    found: set[tuple[float, int]] = set()
    for params in list(iter_rope_parameters(text)) or [{}]:
        plain = _plain(params, head_size)
        if isinstance(plain, str):
            return plain
        found.add(plain)
    if model_type == "gptj":  # vLLM's gpt_j.py: partial_rotary_factor = rotary_dim / head_size
        rotary_dim = getattr(text, "rotary_dim", None)
        if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
            return f"vLLM's GPT-J config gives no rotary_dim (got {rotary_dim!r})"
        found = {(theta, rotary_dim) for theta, _ in found}
    if len(found) > 1:
        return f"vLLM's model uses a RoPE per layer type (rope_theta, rotary_dim: {sorted(found)})"
    theta, dim = found.pop()
    return Rope(theta, dim, style)


def _plain(params: Mapping[str, Any], head_size: int) -> tuple[float, int] | str:
    """``(rope_theta, rotary_dim)`` of one ``rope_parameters`` as ``get_rope`` reads them, or
    why they are not plain RoPE."""
    rope_type = params.get("rope_type", params.get("type", "default"))  # vLLM patches "type"
    if rope_type != "default":
        return (
            f"vLLM's model uses rope_type {rope_type!r} (hf_config rope_parameters): RoPE "
            "scaling the node cannot apply (it re-RoPEs plain RoPE only)"
        )
    if params.get("mrope_section") is not None or params.get("use_fope"):
        return "vLLM's model uses M-RoPE or FoPE (hf_config rope_parameters), not plain RoPE"
    theta = float(params.get("rope_theta", GET_ROPE_THETA))
    dim = params.get("rope_dim") or int(head_size * params.get("partial_rotary_factor", 1.0))
    return theta, int(dim)


def check_rope(
    layout: EngineLayout, url: str, blend: bool, model_config: ModelConfig | None, head_size: int
) -> None:
    """With ``blend``, the node's RoPE must be vLLM's model's (else a refusal naming both
    values, or what could not be read); without, a difference is logged."""
    rope = vllm_rope(model_config, head_size)
    node = Rope(layout.rope_theta, layout.rotary_dim, layout.rope_style)
    if isinstance(rope, str):
        if blend:
            raise InvalidInput(
                f"kvatlas connector: blend is refused: the node at {url} re-RoPEs fragments with "
                f"plain RoPE {asdict(node)}, and {rope}; turn blend off (prefix reuse needs no "
                "re-RoPE)"
            )
        log.info("kvatlas connector: RoPE not compared with the node's (blend is off): %s", rope)
        return
    differ = [
        f"{name} {value!r} (its --{name.replace('_', '-')}), but vLLM's model uses "
        f"{getattr(rope, name)!r}"
        for name, value in asdict(node).items()
        if value != getattr(rope, name)
    ]
    if not differ:
        return
    said = (
        f"the node at {url} re-RoPEs fragments with " + "; ".join(differ) + " (hf_config "
        "rope_parameters, model_type)"
    )
    if blend:
        raise InvalidInput(
            f"kvatlas connector: {said}: its fragments would be rotated wrongly; start the node "
            "with this model's --hf-config (or those flags), or turn blend off"
        )
    log.warning(
        "kvatlas connector: %s: blend would be refused with this node (it is off: prefix "
        "reuse needs no re-RoPE)", said,
    )  # fmt: skip
