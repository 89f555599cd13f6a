"""A simulated vLLM engine (``kvatlas engine-sim``, docs/engine-sim.md): vLLM's OpenAI API,
metrics, paged prefix cache and KV events, with time from a cost model instead of a GPU.

The core (:class:`EngineCore` over a :class:`BlockPool`, timed by a :class:`CostModel`) is pure,
so a discrete-event benchmark can drive it as the server does.
"""

from kvatlas.engine_sim.block_hash import block_hashes, hash_block, none_hash
from kvatlas.engine_sim.config import EngineSimConfig
from kvatlas.engine_sim.cost_model import CostModel
from kvatlas.engine_sim.kv_cache import CPU, GPU, BlockPool
from kvatlas.engine_sim.scheduler import EngineCore, SimRequest, StepOutcome, TokenOutput

__all__ = [
    "CPU",
    "GPU",
    "BlockPool",
    "CostModel",
    "EngineCore",
    "EngineSimConfig",
    "SimRequest",
    "StepOutcome",
    "TokenOutput",
    "block_hashes",
    "hash_block",
    "none_hash",
]
