"""The blend (fragment) index: which cached chunks occur anywhere in a query (docs/blend-index.md).

``index.py`` is the façade (:class:`BlendIndex`: typed-op writes, ``match``, ``stats``);
``ops.py`` the write ops, ``op_columns.py`` them as validated columns (``op_checks.py``: which
objects the index keeps as they are); ``state.py`` the state and its one write path; ``namespaces.py``
namespace ids; ``_cpython.py`` the CPython-layout shortcuts of the hot paths; ``kernels/``
the compiled kernels, one module per structure.
"""

from kvatlas.directory.blend.index import BlendIndex, BlendStats
from kvatlas.directory.blend.match_columns import MatchColumns
from kvatlas.directory.blend.ops import (
    AddColumns,
    AddOp,
    BlendOp,
    RemoveChunkOp,
    RemoveClaimColumns,
    RemoveClaimOp,
)

__all__ = [
    "AddColumns",
    "AddOp",
    "BlendIndex",
    "BlendOp",
    "BlendStats",
    "MatchColumns",
    "RemoveChunkOp",
    "RemoveClaimColumns",
    "RemoveClaimOp",
]
