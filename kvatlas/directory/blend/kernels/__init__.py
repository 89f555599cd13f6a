"""Compiled (numba) kernels of the blend index; all state is in ``layout.BlendArrays``.

One module per structure: ``modhash`` (the keyed mod 2^61-1 fingerprint and its rolling
lanes), ``table`` (open addressing with one backward-shift delete), ``occupants`` (chunk hashes
and their namespace claims), ``writes`` (the one write kernel), ``scan`` (the match kernel),
``firsts`` (the first hit of each chunk_hash), ``planes`` (the planes form of stored token ids:
``directory/token_store.py``), ``contents`` (a stored content: one ``bytes``, its ids inline
after a header naming their form) and ``anchors`` (where a content can start in a query: its
anchor table and the query's window minima, what the scan probes). ``pointers`` holds the
raw-memory intrinsics they share. Kernels run only while the caller holds the index lock.
"""

from kvatlas.directory.blend.kernels.anchors import query_minima, query_minima_releasing
from kvatlas.directory.blend.kernels.firsts import joined_firsts
from kvatlas.directory.blend.kernels.layout import BlendArrays
from kvatlas.directory.blend.kernels.modhash import (
    LANES,
    MERSENNE61,
    fingerprint,
    lane_init,
    lane_load,
    lane_step,
)
from kvatlas.directory.blend.kernels.occupants import (
    F_CLAIM_DROPPED,
    F_CONTENT_GONE,
    F_EXTRA_CLAIM,
    F_NEW_CLAIM,
    F_NEW_CONTENT,
    F_NEW_OCCUPANT,
    F_OCCUPANT_GONE,
    drop_extra_claim,
)
from kvatlas.directory.blend.kernels.pointers import jit
from kvatlas.directory.blend.kernels.scan import RELEASE_WINDOWS, scan, scan_releasing
from kvatlas.directory.blend.kernels.table import claims_rehash
from kvatlas.directory.blend.kernels.writes import (
    ADD,
    RELEASE_OPS,
    REMOVE_CHUNK,
    REMOVE_CLAIM,
    SKIP,
    apply_op,
    apply_ops,
    apply_ops_releasing,
    rebuild,
)

__all__ = [
    "ADD",
    "F_CLAIM_DROPPED",
    "F_CONTENT_GONE",
    "F_EXTRA_CLAIM",
    "F_NEW_CLAIM",
    "F_NEW_CONTENT",
    "F_NEW_OCCUPANT",
    "F_OCCUPANT_GONE",
    "LANES",
    "MERSENNE61",
    "RELEASE_OPS",
    "RELEASE_WINDOWS",
    "REMOVE_CHUNK",
    "REMOVE_CLAIM",
    "SKIP",
    "BlendArrays",
    "apply_op",
    "apply_ops",
    "apply_ops_releasing",
    "claims_rehash",
    "drop_extra_claim",
    "fingerprint",
    "jit",
    "joined_firsts",
    "lane_init",
    "lane_load",
    "lane_step",
    "query_minima",
    "query_minima_releasing",
    "rebuild",
    "scan",
    "scan_releasing",
]
