"""Load (or, on a cold numba cache, compile) the lookups' own kernels before serving: those the
directory's warm-up (``kvatlas.directory.warm_up``) cannot reach. Else the first lookup of a
fresh process compiles them."""

from __future__ import annotations

import numpy as np

from kvatlas.coordinator._blend_reply import blend_reply
from kvatlas.coordinator._lookup_reply import json_id_lists
from kvatlas.directory import MatchColumns


def warm_up_lookup_kernels() -> None:
    """The blend reply's writer, the prefix lookup reply's ids."""
    blend_reply(MatchColumns.of([bytes(32)], np.zeros(1, np.int64), np.ones(1, np.int64)), True)
    json_id_lists([np.arange(3, dtype=np.uint32)])
