"""Cache keys: chunk hashes, ObjectKeys, namespaces, multimodal identity, request tracking.

Everything else in kvatlas keys by what this package produces, so its guarantees (docs/keys.md)
are the fleet's. Import from here; the submodules are implementation detail. Importing it loads
no numba: the multimodal-values kernel compiles or loads on its first use.
"""

from kvatlas.keys.adapters import EngineRequestView, extract_request
from kvatlas.keys.chunk_hash import (
    DEFAULT_CHUNK_SIZE,
    NONE_HASH,
    ChunkHashChain,
    chunk_hashes,
    segment_hashes,
)
from kvatlas.keys.extra_keys import MMItem
from kvatlas.keys.mm_substitution import PlaceholderSpan, apply_mm_hashes_to_token_ids
from kvatlas.keys.mm_values import (
    clear_value_cache,
    mm_hash_to_token_values,
    mm_hash_values,
    warm_up_mm_values,
)
from kvatlas.keys.namespace import BlendMatch, BlendNamespace, leftmost_greedy
from kvatlas.keys.object_key import (
    MAX_MODEL_NAME_CHARS,
    ObjectKey,
    check_cache_salt,
    check_instance_id,
    check_model_name,
    check_wire_model_name,
    chunk_hash_of,
    expand_prefix_keys,
    object_keys,
    pack_kv_rank,
    parse_chunk_hash_hex,
    unpack_kv_rank,
)
from kvatlas.keys.scheme import (
    SCHEME_BLAKE3,
    SCHEME_BLAKE3_X1,
    SCHEMES,
    KeyScheme,
    KeySchemeMismatch,
)
from kvatlas.keys.tokens import TokenArray, as_token_array
from kvatlas.keys.tracker import MM_BYPASS_GUARD, BypassGuard, RequestTracker

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MAX_MODEL_NAME_CHARS",
    "MM_BYPASS_GUARD",
    "NONE_HASH",
    "SCHEMES",
    "SCHEME_BLAKE3",
    "SCHEME_BLAKE3_X1",
    "BlendMatch",
    "BlendNamespace",
    "BypassGuard",
    "ChunkHashChain",
    "EngineRequestView",
    "KeyScheme",
    "KeySchemeMismatch",
    "MMItem",
    "ObjectKey",
    "PlaceholderSpan",
    "RequestTracker",
    "TokenArray",
    "apply_mm_hashes_to_token_ids",
    "as_token_array",
    "check_cache_salt",
    "check_instance_id",
    "check_model_name",
    "check_wire_model_name",
    "chunk_hash_of",
    "chunk_hashes",
    "clear_value_cache",
    "expand_prefix_keys",
    "extract_request",
    "leftmost_greedy",
    "mm_hash_to_token_values",
    "mm_hash_values",
    "object_keys",
    "pack_kv_rank",
    "parse_chunk_hash_hex",
    "segment_hashes",
    "unpack_kv_rank",
    "warm_up_mm_values",
]
