"""Cache keys: chunk hashes, ObjectKeys, namespaces, multimodal identity, request tracking."""

from kvatlas.keys.chunk_hash import (
    DEFAULT_CHUNK_SIZE,
    NONE_HASH,
    ChunkHashChain,
    chunk_hashes,
    segment_hashes,
)
from kvatlas.keys.namespace import BlendNamespace
from kvatlas.keys.object_key import (
    ObjectKey,
    expand_prefix_keys,
    pack_kv_rank,
    parse_chunk_hash_hex,
    unpack_kv_rank,
)
from kvatlas.keys.tokens import as_token_array

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "NONE_HASH",
    "BlendNamespace",
    "ChunkHashChain",
    "ObjectKey",
    "as_token_array",
    "chunk_hashes",
    "expand_prefix_keys",
    "pack_kv_rank",
    "parse_chunk_hash_hex",
    "segment_hashes",
    "unpack_kv_rank",
]
