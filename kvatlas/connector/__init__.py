"""kvatlas as vLLM's KV connector (docs/vllm.md): a ``KVConnectorBase_V1`` whose KV store is
a kvatlas cache node, reached over its engine API (:class:`kvatlas.client.EngineClient`).

Imports vLLM: load it only inside a vLLM engine (``--kv-transfer-config`` names
``kvatlas.connector`` as ``kv_connector_module_path`` and ``KvatlasConnector``).
"""

from kvatlas.connector.connector import (
    KvatlasConnector,
    check_cache,
    check_layout,
    check_model,
)
from kvatlas.connector.metadata import KvatlasConnectorMetadata, LoadOp, RequestKeys, StoreOp
from kvatlas.connector.rope_check import Rope, check_rope, vllm_rope
from kvatlas.connector.settings import KV_PACKINGS, ConnectorSettings

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
