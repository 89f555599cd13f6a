"""The one way a test asks for vLLM's own code: never a silent skip (tests/torch_support.py).

``make test`` installs vLLM 0.33.0 without its GPU dependencies (requirements/vllm-cpu.txt).
Under ``CI`` a missing or broken install fails the test; locally it skips with the reason.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from tests.torch_support import ci_enabled

VLLM_VERSION = "0.33.0"


def require_vllm(module: str = "vllm.distributed.kv_events") -> ModuleType:
    """Import ``module`` of the pinned vLLM, or fail (under CI) / skip (locally) saying why."""
    try:
        vllm = importlib.import_module("vllm")
        mod = importlib.import_module(module)
    except ImportError as exc:
        reason = f"vLLM's {module} does not import ({exc}); `make test` installs it"
        if ci_enabled():
            pytest.fail(reason)
        pytest.skip(reason)
    if vllm.__version__ != VLLM_VERSION:
        pytest.fail(f"vLLM {vllm.__version__} installed, the interop tests pin {VLLM_VERSION}")
    return mod
