"""One stored KV chunk and its self-describing, checksummed binary form.

The same bytes go to every place a chunk leaves process memory -- a file in the ``fs`` L2, a
value in the Redis L2, an element of a peer reply -- so a chunk written by one node can be read
by any other without side information (dtype, shape, tokens and key all travel with it).

Layout (all integers little-endian)::

    magic b"KVAC" | version u8 | flags u8 (0) | header_len u32 | header (msgpack map)
    | zero padding to a 16-byte boundary | KV bytes (C order) | tokens (uint32 LE)
    | blake3(everything before)[:16]

The trailing digest covers the whole record, so a torn write (truncation) or a flipped bit
anywhere is a :class:`ChunkDecodeError`, never a silently wrong KV: wrong KV does not fail
loudly downstream, it just makes the model attend to garbage.

**bfloat16** is stored as its raw 16-bit patterns under the dtype name ``"bfloat16"`` and
decodes to an ``ml_dtypes.bfloat16`` array, like every bf16 chunk (:mod:`kvatlas.node.kv_dtype`:
torch ``bfloat16`` tensors, ``ml_dtypes`` arrays and ``uint16`` bit patterns declared with
``kv_dtype="bfloat16"`` are all accepted). Widening to float32 instead would double every byte
budget and break bit-exact round trips.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Final

import blake3
import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.checks import is_plain_int
from kvatlas.errors import InvalidInput
from kvatlas.keys import ObjectKey, as_token_array
from kvatlas.node.kv_dtype import (
    KV_DTYPES,
    KV_ITEMSIZE,
    is_torch,
    numpy_dtype,
    resolve,
    to_numpy,
    to_torch,
)

MAGIC: Final = b"KVAC"
VERSION: Final = 1

_PREFIX = struct.Struct("<4sBBI")  # magic, version, flags, header_len
_DIGEST_BYTES: Final = 16
_ALIGN: Final = 16  # KV bytes start 16-byte aligned within the record: cheap, SIMD-friendly views
_MAX_HEADER_BYTES: Final = 64 * 1024
_MAX_RANK: Final = 16
_STORAGE_DTYPE: Final = {"float16": "<f2", "bfloat16": "<u2", "float32": "<f4"}
"""Each dtype's little-endian storage unit (bf16 as its bit patterns)."""


class ChunkDecodeError(InvalidInput):
    """The bytes are not a complete, intact encoded chunk (torn, corrupt or foreign).

    An :class:`~kvatlas.errors.InvalidInput` (so still a ``ValueError``)."""


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    key: dict[str, Any]
    dtype: str
    shape: list[int]
    token_offset: int
    n_tokens: int  # -1: the chunk carries no token ids (distinct from an empty token array)


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)


@dataclass(frozen=True, slots=True, eq=False)
class StoredChunk:
    """A chunk's KV plus what the fleet needs to index and reuse it.

    ``kv`` is a numpy array or a torch tensor shaped
    ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` (the codec itself is rank-agnostic).
    L1 keeps whatever the engine handed over (no copy); encoding converts to numpy.
    ``tokens`` are the chunk's token ids and ``token_offset`` its position in the sequence it was
    stored with -- the coordinator indexes content from them; ``-1`` means unknown and is never
    indexed (a wrong position would re-RoPE to wrong KV). ``kv_dtype`` is filled in from ``kv``;
    pass it only to declare ``uint16`` bit patterns as ``"bfloat16"`` (``kv`` then becomes
    their ``ml_dtypes.bfloat16`` view).

    Equality is identity (``eq=False``): array equality is elementwise, not a bool.
    """

    key: ObjectKey
    kv: Any
    tokens: npt.NDArray[np.uint32] | None = None
    token_offset: int = -1
    kv_dtype: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.key, ObjectKey):
            raise TypeError(f"key must be an ObjectKey, got {type(self.key).__name__}")
        kv, name = resolve(self.kv, self.kv_dtype)
        object.__setattr__(self, "kv", kv)
        object.__setattr__(self, "kv_dtype", name)
        if self.tokens is not None:
            object.__setattr__(self, "tokens", as_token_array(self.tokens))
        offset = self.token_offset
        if not is_plain_int(offset) or offset < -1:
            raise ValueError(f"token_offset must be an int >= -1, got {offset!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of KV held (what L1 budgets against; tokens are noise next to KV)."""
        if is_torch(self.kv):
            return int(self.kv.numel()) * int(self.kv.element_size())
        return int(self.kv.nbytes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.kv.shape)

    def numpy_kv(self) -> np.ndarray[Any, Any]:
        """``kv`` as a C-contiguous numpy array (a view of a contiguous CPU tensor)."""
        arr = to_numpy(self.kv)
        # not np.ascontiguousarray: it promotes a 0-d array to 1-d, and the codec keeps rank
        return arr if arr.flags.c_contiguous else arr.copy(order="C")

    def torch_kv(self) -> Any:
        """``kv`` as a torch tensor of the chunk's dtype (imports torch; only call when wanted).

        Shares memory with ``kv`` when possible (a read-only decoded array is copied first:
        torch tensors are always writable).
        """
        return self.kv if is_torch(self.kv) else to_torch(self.numpy_kv())


def _storage_view(chunk: StoredChunk) -> np.ndarray[Any, Any]:
    """The KV as little-endian storage units (bf16 as its uint16 bit patterns)."""
    arr = chunk.numpy_kv()
    if chunk.kv_dtype == "bfloat16":
        arr = arr.view(np.uint16)
    return arr.astype(_STORAGE_DTYPE[chunk.kv_dtype], order="C", copy=False)


def encode_chunk(chunk: StoredChunk) -> bytes:
    """Serialize ``chunk`` (see the module docstring for the layout)."""
    kv = _storage_view(chunk)
    tokens = b""
    n_tokens = -1
    if chunk.tokens is not None:
        tokens = chunk.tokens.astype("<u4", copy=False).tobytes()
        n_tokens = int(chunk.tokens.size)
    header = _header_encoder.encode(
        _Header(
            key=chunk.key.to_wire(),
            dtype=chunk.kv_dtype,
            shape=[int(d) for d in kv.shape],
            token_offset=chunk.token_offset,
            n_tokens=n_tokens,
        )
    )
    head = _PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header
    head += b"\0" * (-len(head) % _ALIGN)
    kv_bytes = kv.reshape(-1).view(np.uint8).data
    hasher = blake3.blake3(head)
    hasher.update(kv_bytes)
    hasher.update(tokens)
    return b"".join((head, kv_bytes, tokens, hasher.digest(_DIGEST_BYTES)))


def _decode_kv(dtype: str, shape: tuple[int, ...], raw: memoryview) -> np.ndarray[Any, Any]:
    """The KV bytes as a (read-only) array of ``dtype``: a view on little-endian machines."""
    stored = np.frombuffer(raw, dtype=_STORAGE_DTYPE[dtype]).reshape(shape)
    native = stored.astype(stored.dtype.newbyteorder("="), copy=False)
    return native.view(numpy_dtype(dtype))


def decode_chunk(data: bytes | bytearray | memoryview) -> StoredChunk:
    """Parse and verify an encoded chunk; any defect raises :class:`ChunkDecodeError`.

    The arrays are read-only views into ``data`` (no copy): stored KV is immutable, and a
    consumer that modifies KV (re-RoPE) writes into a new array anyway.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < _PREFIX.size + _DIGEST_BYTES:
        raise ChunkDecodeError(f"{len(buf)} bytes is too short for an encoded chunk")
    magic, version, flags, header_len = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise ChunkDecodeError("not an encoded chunk (bad magic)")
    if version != VERSION or flags != 0:
        raise ChunkDecodeError(f"unsupported chunk format version {version} / flags {flags}")
    if header_len > _MAX_HEADER_BYTES or _PREFIX.size + header_len > len(buf) - _DIGEST_BYTES:
        raise ChunkDecodeError(f"header length {header_len} does not fit the record")
    body = buf[: len(buf) - _DIGEST_BYTES]
    if blake3.blake3(body).digest(_DIGEST_BYTES) != bytes(buf[len(body) :]):
        raise ChunkDecodeError("checksum mismatch: the chunk is torn or corrupt")
    try:
        header = _header_decoder.decode(buf[_PREFIX.size : _PREFIX.size + header_len])
        key = ObjectKey.from_wire(header.key)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise ChunkDecodeError(f"bad chunk header: {exc}") from None
    shape = tuple(header.shape)
    if header.dtype not in KV_DTYPES:
        raise ChunkDecodeError(f"unknown kv dtype {header.dtype!r}")
    if len(shape) > _MAX_RANK or any(d < 0 for d in shape):
        raise ChunkDecodeError(f"bad kv shape {shape}")
    if header.n_tokens < -1 or header.token_offset < -1:
        raise ChunkDecodeError("bad token count or offset")
    start = _PREFIX.size + header_len
    start += -start % _ALIGN
    kv_len = math.prod(shape) * KV_ITEMSIZE[header.dtype]
    tok_len = max(header.n_tokens, 0) * 4
    if start + kv_len + tok_len != len(body):
        raise ChunkDecodeError("record length does not match its header")
    kv = _decode_kv(header.dtype, shape, body[start : start + kv_len])
    tokens = None
    if header.n_tokens >= 0:
        raw_tokens = np.frombuffer(body[start + kv_len :], dtype="<u4")
        tokens = raw_tokens.astype(np.uint32, copy=False)
    try:
        return StoredChunk(key, kv, tokens, header.token_offset)
    except (ValueError, TypeError) as exc:
        raise ChunkDecodeError(f"bad chunk: {exc}") from None
