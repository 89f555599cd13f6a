"""kvatlas as vLLM's KV connector (docs/vllm.md): a ``KVConnectorBase_V1`` whose KV store is
a kvatlas cache node, reached over its engine API (:class:`kvatlas.client.EngineClient`).

vLLM loads it inside an engine (``--kv-transfer-config`` names ``kvatlas.connector`` as
``kv_connector_module_path`` and ``KvatlasConnector``). Its settings (:class:`ConnectorSettings`,
:data:`KV_PACKINGS`) import without vLLM; every other name imports vLLM (and torch) when it is
first used, so reading or checking a connector's settings does not cost their ≈10 s import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvatlas.connector.settings import KV_PACKINGS, ConnectorSettings
from kvatlas.lazy_exports import lazy_export

if TYPE_CHECKING:
    from kvatlas.connector.connector import (
        KvatlasConnector,
        check_cache,
        check_layout,
        check_model,
    )
    from kvatlas.connector.metadata import (
        KvatlasConnectorMetadata,
        LoadOp,
        RequestKeys,
        StoreOp,
    )
    from kvatlas.connector.rope_check import Rope, check_rope, vllm_rope

_EXPORTS = {
    **dict.fromkeys(
        ("KvatlasConnector", "check_cache", "check_layout", "check_model"),
        "connector",
    ),
    **dict.fromkeys(
        ("KvatlasConnectorMetadata", "LoadOp", "RequestKeys", "StoreOp"),
        "metadata",
    ),
    **dict.fromkeys(("Rope", "check_rope", "vllm_rope"), "rope_check"),
}
"""The names imported on first use (each imports vLLM), and their submodule."""


def __getattr__(name: str) -> Any:
    return lazy_export(__name__, _EXPORTS, globals(), name)


__all__ = [
    "KV_PACKINGS",
    "ConnectorSettings",
    "KvatlasConnector",
    "KvatlasConnectorMetadata",
    "LoadOp",
    "RequestKeys",
    "Rope",
    "StoreOp",
    "check_cache",
    "check_layout",
    "check_model",
    "check_rope",
    "vllm_rope",
]
