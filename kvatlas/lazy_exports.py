"""A package's names imported on first use (PEP 562): each package whose ``__init__`` would
otherwise import a heavy module (numba, the directory, vLLM) for a name most importers never
use keeps an ``_EXPORTS`` map (name → submodule) and a one-line ``__getattr__`` calling
:func:`lazy_export`. Stdlib only."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any


def lazy_export(
    package: str, exports: Mapping[str, str], namespace: MutableMapping[str, Any], name: str
) -> Any:
    """``package``'s ``name``, imported from its submodule ``exports[name]`` and kept in the
    package's ``namespace`` (so later reads skip this); ``AttributeError`` for any other."""
    if name not in exports:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
    namespace[name] = value
    return value
