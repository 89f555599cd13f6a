"""The type both the JSON codec and its compiled scanner speak, in a module of its own so that
neither imports the other for it (the codec loads the scanner, and numba, only when used)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

CutTokenLists = tuple[
    npt.NDArray[np.uint8], npt.NDArray[np.uint32], npt.NDArray[np.int64], npt.NDArray[np.int64]
]
"""What the compiled scanner (``_json_cut.cut_token_lists``) gives: the body with its token
lists cut out, the ids, each entry's count of ids and each batch's count of entries."""
