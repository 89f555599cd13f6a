"""The connector tests' shared fixture: the tiny Llama's KV model."""

from __future__ import annotations

import pytest

from kvatlas.node.config import NodeConfig
from kvatlas.node.toy_model import ToyRopeModel
from tests.vllm_support import require_vllm


@pytest.fixture(scope="module")
def model() -> ToyRopeModel:
    """KV of the tiny Llama every connector test's node serves (``--model-name tiny``: two
    layers, two KV heads of 16 dims, 16-token chunks, float32)."""
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    layout = NodeConfig(
        model_name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=16, dtype="float32"
    ).layout
    return ToyRopeModel(layout, seed=3)
