"""An engine's token chain, block by block: where it stands after each block
(:data:`ChainPoint`: the last complete chunk's hash and the tokens since) and the step to the
next block (:func:`advance`), which keys a chunk once its last block arrives (``chunk_size`` is
a multiple of ``block_size``; a partial chunk waits in the point).

Extra keys (multimodal identities, a LoRA adapter) change the KV without changing the token
ids. Under ``blake3-x1`` they enter the chunk hash (each block's identities as an item spanning
that block, the adapter as the request key ``lora``); under ``blake3`` such a chain is marked
un-indexable (``keyable`` False). A chain with any of them is never ``plain``: its chunks never
get a text-only key. See docs/kv-events.md.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from kvatlas.events.vllm_wire import BlockHash
from kvatlas.keys import NONE_HASH, KeyScheme, MMItem
from kvatlas.keys.chunk_hash import chain_hashes
from kvatlas.keys.extra_keys import x1_chunk_suffix_fn

# A chain point and a block are plain tuples, not objects: CPython stops tracking a tuple of
# atoms (bytes, int, str, bool, None and such tuples) at its first collection, so the block map
# of text chains adds nothing to full collections. As tracked objects, a block map at the
# bound (--kv-events-max-blocks) would lengthen every full collection by its walk: a stall for
# every client. Their layouts are private to the re-keying (this module and .rekey).

ChainPoint = tuple[
    bytes,  # prev: hash of the last complete chunk (NONE_HASH before the first)
    int,  # n_chunks: complete chunks so far
    int,  # fill: tokens after the last chunk boundary (fewer than chunk_size)
    "ChainPoint | None",  # back: the point before this one in the partial chunk
    BlockHash | None,  # block: the block this point comes after
    bytes,  # packed: this block's tokens, big-endian uint32 (only while fill > 0)
    tuple[MMItem, ...],  # items: this block's extra keys, as items with absolute spans
    str | int | None,  # lora: the chain's adapter
    bool,  # plain: no extra keys and no adapter anywhere in the chain
    bool,  # keyable: False: the scheme cannot carry what the chain holds
]
"""Where an engine's token chain stands after one block. Inside a partial chunk a point holds
only its own block (``packed``, ``items``) and links to the point before it, so a block costs
its own tokens, not the whole partial chunk."""

_FILL: Final = 2  # (named positions of the fields read one at a time)
_BACK: Final = 3
BLOCK: Final = 4
_PACKED: Final = 5
_ITEMS: Final = 6
_LORA: Final = 7
_PLAIN: Final = 8
_KEYABLE: Final = 9

START: Final[ChainPoint] = (NONE_HASH, 0, 0, None, None, b"", (), None, True, True)

Placed = tuple[bytes, str, str]  # a chunk holding a block: (chunk hash, model, tier placed in)

Block = tuple[ChainPoint, tuple[str, ...], tuple[Placed, ...]]
"""A stored block: its chain point, the tiers the engine holds it in (GPU, and maybe its CPU
offload too), and the chunks holding it: one per continuation (requests that share a block
inside a chunk and then diverge make two chunks, both gone with the block) and per tier."""


def partial(point: ChainPoint) -> list[ChainPoint]:
    """The points of the partial chunk up to ``point``, oldest first."""
    out: list[ChainPoint] = []
    p: ChainPoint | None = point
    while p is not None and p[_FILL]:
        out.append(p)
        p = p[_BACK]
    return out[::-1]


def _identity(value: Any) -> str:
    """One extra key as an item identifier: a string as it is, anything else (any value
    msgpack decodes to) as ``m:`` + the hex of its msgpack encoding."""
    return value if isinstance(value, str) else "m:" + msgspec.msgpack.encode(value).hex()


def advance(
    scheme: KeyScheme,
    point: ChainPoint,
    h: BlockHash,
    packed: bytes,
    extra: list[Any] | None,
    lora: str | int | None,
) -> tuple[ChainPoint, bytes | None]:
    """The chain after one more block, and the chunk it completed (``None``: partial)."""
    chunk_size = scheme.chunk_size
    prev, n_chunks, fill, _, _, _, _, point_lora, point_plain, point_keyable = point
    n = len(packed) // 4
    items: tuple[MMItem, ...] = ()
    if extra:
        start = n_chunks * chunk_size + fill
        items = tuple(MMItem.of(_identity(v), start, n) for v in extra)
    plain = point_plain and not items and lora is None
    keyable = (
        point_keyable
        and (lora == point_lora or point is START)
        and (plain or scheme.carries_extra_keys)
    )
    if fill + n < chunk_size:
        back = point if fill else None
        return (prev, n_chunks, fill + n, back, h, packed, items, lora, plain, keyable), None
    earlier = partial(point)
    chunk = b"".join([p[_PACKED] for p in earlier] + [packed])
    suffix = None
    if scheme.carries_extra_keys:
        all_items = [it for p in earlier for it in p[_ITEMS]] + list(items)
        request = {"lora": lora} if lora is not None else None
        suffix = x1_chunk_suffix_fn(chunk_size, all_items, request)
    prev = chain_hashes(chunk, chunk_size, prev, n_chunks, suffix)[0]
    return (prev, n_chunks + 1, 0, None, h, b"", (), lora, plain, keyable), chunk


def plain_run(point: ChainPoint, size: int, lora: str | int | None) -> bool:
    """Whether :func:`advance_run` can take blocks of ``size`` tokens after ``point``: no
    adapter, the chain plain and keyable so far, and ``point``'s partial chunk a whole
    number of such blocks (so each chunk ends at a block's end). Extra keys are the caller's
    to rule out."""
    return (
        lora is None
        and point[_PLAIN]
        and point[_KEYABLE]
        and point[_LORA] is None
        and point[_FILL] % size == 0
    )


def advance_run(
    scheme: KeyScheme, point: ChainPoint, hashes: list[BlockHash], packed: bytes, size: int
) -> tuple[list[ChainPoint], list[bytes], list[bytes]]:
    """:func:`advance` over each of ``hashes``' blocks in turn (``packed``: their tokens end
    to end, ``size`` per block), when :func:`plain_run` holds and no block has extra keys:
    each block's point, then the hashes and tokens of the chunks the run completed, in
    order. The run's chunks are hashed by one :func:`chain_hashes` call and each block is a
    tuple built in one loop, where :func:`advance` builds the chain block by block."""
    chunk_size = scheme.chunk_size
    prev, n_chunks, fill = point[0], point[1], point[_FILL]
    step = 4 * size
    done = (fill + len(hashes) * size) // chunk_size
    stream = b"".join([p[_PACKED] for p in partial(point)] + [packed]) if fill and done else packed
    cstep = 4 * chunk_size
    chunks = [stream[i * cstep : (i + 1) * cstep] for i in range(done)]
    suffix = x1_chunk_suffix_fn(chunk_size, [], None) if scheme.carries_extra_keys else None
    done_hashes = chain_hashes(stream, chunk_size, prev, n_chunks, suffix)  # (its whole chunks)
    points: list[ChainPoint] = []
    back: ChainPoint | None = point if fill else None
    at, c = 0, 0
    for h in hashes:
        fill += size
        if fill < chunk_size:
            back = (prev, n_chunks, fill, back, h, packed[at : at + step], (), None, True, True)
            points.append(back)
        else:
            prev = done_hashes[c]
            c += 1
            n_chunks += 1
            fill = 0
            back = None
            points.append((prev, n_chunks, 0, None, h, b"", (), None, True, True))
        at += step
    return points, done_hashes, chunks
