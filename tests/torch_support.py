"""The one way a test asks for torch: never a silent skip (README.md, "Quick start").

torch is an optional extra, so a machine without it runs the numpy path only. Under ``CI``
(the variable CI systems set) a missing torch is a broken install and fails the test; locally
the test skips with a reason that ``pytest -ra`` prints, and the session header says so too.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

_TRUTHY = {"1", "true", "yes", "on"}


def ci_enabled() -> bool:
    """Whether ``CI`` is set to a true value (``true``, ``1``, ``yes``, ``on``; any case)."""
    return os.environ.get("CI", "").strip().lower() in _TRUTHY


def torch_import_error() -> ImportError | None:
    """The error ``import torch`` raises here, or ``None`` when torch imports."""
    try:
        importlib.import_module("torch")
    except ImportError as exc:
        return exc
    return None


def torch_status() -> str:
    """One line for the pytest header: the torch version, or why torch-path tests won't run."""
    error = torch_import_error()
    if error is not None:
        outcome = "FAIL (CI is set)" if ci_enabled() else "skip"
        return f"torch: NOT INSTALLED ({error}); torch-path tests will {outcome}"
    version = getattr(importlib.import_module("torch"), "__version__", "unknown version")
    return f"torch: {version}"


def require_torch() -> ModuleType:
    """Return the torch module; without it, fail under ``CI`` and skip (with a reason) locally."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        if ci_enabled():
            pytest.fail(f"torch is required under CI but does not import ({exc}); see `make`")
        pytest.skip(f"torch not installed ({exc}): torch-path test skipped; `make` retries it")
