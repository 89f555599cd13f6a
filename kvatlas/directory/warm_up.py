"""Load (or, on a cold numba cache, compile) the compiled kernels before serving.

Without this the first real request of a fresh process pays the JIT — seconds on a cold cache —
and blows a client's timeout (a blend lookup would silently degrade to local-only).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvatlas.directory.blend import AddColumns, AddOp, BlendIndex, RemoveChunkOp
from kvatlas.directory.blend.anchors import Anchors
from kvatlas.directory.blend.kernels.anchors import new_keys
from kvatlas.directory.row_maps import warm_up_row_maps
from kvatlas.directory.token_store import (
    content_sizes,
    stored_batch,
    stored_from_arena,
    stored_shapes,
)
from kvatlas.events import (
    CacheEntry,
    EventBatch,
    decode_json,
    decode_json_columns,
    decode_msgpack_columns,
    encode_json,
    encode_msgpack,
)
from kvatlas.events.inventory import BUCKETS, xor_elements
from kvatlas.kernel_twins import compile_releasing_twins
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank

log = logging.getLogger(__name__)


def warm_up_kernels() -> float:
    """Exercise every compiled path once; returns the seconds it took."""
    started = time.perf_counter()
    warm_up_index()
    warm_up_row_maps()  # the chunk table's hash → row maps
    warm_up_events()
    compile_releasing_twins()  # what long calls take: each kernel above, the GIL released
    elapsed = time.perf_counter() - started
    log.info("compiled kernels ready in %.2f s", elapsed)
    return elapsed


def warm_up_index() -> None:
    """The blend index's and the token storage's kernels."""
    namespace = BlendNamespace("warm-up")
    index = BlendIndex(chunk_size=2)
    index.add([1, 2], bytes(32), 0, namespace)  # a single write
    spaces = [BlendNamespace("warm-up", cache_salt=str(i)) for i in range(9)]
    index.apply(  # a batch, growing the extra-claim set, then dropping its claims
        [AddOp([3, 4], bytes(32), 0, ns) for ns in spaces] + [RemoveChunkOp([3, 4], bytes(32))]
    )
    index.match([0, 1, 2, 3], namespace)
    tokens = np.array([1, 2], dtype=np.uint32)
    (compact,) = stored_batch([tokens])  # the directory's token storage
    stored_from_arena(tokens, np.zeros(1, np.int64), np.ones(1, np.int64))
    index.add(compact, bytes(31), 0, namespace)  # a uint16 content, shared
    index.apply([AddColumns([compact], [bytes(30)], [0], [namespace])])  # checked columns
    wide = np.arange(1 << 16, (1 << 16) + 16, dtype=np.uint32)
    (planes,) = stored_batch([wide])  # the planes form (16 ids of 17 bits)
    assert compact is not None and planes is not None
    stored_shapes([compact, planes])  # what a snapshot reads of each content
    content_sizes(np.ones(1, np.int64), np.full(1, 17, np.int64))  # what a restore allocates
    planes_index = BlendIndex(chunk_size=16)
    planes_index.add(planes, bytes(32), 0, namespace)
    planes_index.match(np.concatenate([wide, wide]), namespace)
    planes_index.fingerprint_key.of([planes])  # what a snapshot saves of each content
    saved = planes_index.anchor_key.of([planes])  # (and its anchor), and a restore adopts
    Anchors(16, new_keys()).adopt(planes_index.anchor_key, saved, 1)
    grown = BlendIndex(chunk_size=2)  # past its first table: the rebuild kernel
    many = 1100  # > half the slots of MIN_CAPACITY's table (state.py)
    grown.apply(
        [AddColumns([np.array([i, i + 1], np.uint32) for i in range(0, 2 * many, 2)],
                    [i.to_bytes(32, "big") for i in range(many)], [0] * many, [namespace])]
    )  # fmt: skip


def warm_up_events() -> None:
    """The event decoders' kernels (the JSON token cut and entry parser, the msgpack rows)
    and the inventory digests' step."""
    tokens = np.array([1, 2], dtype=np.uint32)
    entry = CacheEntry(ObjectKey(bytes(32), "warm-up", pack_kv_rank(1, 0, 1, 0)), 0, tokens, 0)
    batches = [EventBatch("warm-up", 1, 1, "store", "l1", "dram", entries=(entry,))]
    body = encode_json(batches)
    decode_json(body)
    decode_json_columns(body)  # the service's path: the compiled token cut
    decode_msgpack_columns(encode_msgpack(batches))
    digest = np.zeros(BUCKETS, np.uint64)  # the inventory digests' step, every bucket or some
    xor_elements(digest, [bytes(32)], 1)
    xor_elements(digest, [bytes(32)], 1, np.ones(BUCKETS, np.uint8))
