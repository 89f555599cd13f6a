"""The chunk codec and the L2 adapters: real files in tmp_path, a real redis-server."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.errors import InvalidInput, Unavailable
from kvatlas.keys import ObjectKey
from kvatlas.node.l2 import FsL2, L2Backend, L2Unavailable, RedisL2, key_digest
from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk, decode_chunk, encode_chunk
from tests.conftest import RedisServer, wait_for
from tests.torch_support import require_torch

KV_SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, chunk_size, kv_heads, head_dim]


def key(i: int, model: str = "meta-llama/Llama-3.1-8B", salt: str = "") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), model, 1 << 24 | 1 << 8, 0, salt)


def chunk(i: int, model: str = "meta-llama/Llama-3.1-8B", salt: str = "") -> StoredChunk:
    rng = np.random.default_rng(i)
    kv = rng.standard_normal(KV_SHAPE).astype(np.float16)
    tokens = rng.integers(0, 2**32, size=4, dtype=np.uint32)
    return StoredChunk(key(i, model, salt), kv, tokens, 4 * i)


def bits(c: StoredChunk) -> np.ndarray[Any, Any]:
    """The KV's raw bit patterns (NaNs and bf16 compare exactly)."""
    arr = c.numpy_kv()
    return arr.view(np.uint16 if arr.dtype.itemsize == 2 else np.uint32)


def assert_same(a: StoredChunk, b: StoredChunk) -> None:
    assert a.key == b.key
    assert a.kv_dtype == b.kv_dtype
    assert a.shape == b.shape
    assert np.array_equal(bits(a), bits(b))
    assert a.token_offset == b.token_offset
    if a.tokens is None:
        assert b.tokens is None
    else:
        assert b.tokens is not None and b.tokens.dtype == np.uint32
        assert np.array_equal(a.tokens, b.tokens)


# -- codec -------------------------------------------------------------------------------


@st.composite
def chunks(draw: st.DrawFn) -> StoredChunk:
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=5)))
    dtype = draw(st.sampled_from(["float16", "float32", "bfloat16"]))
    n = int(np.prod(shape, dtype=np.int64))
    itemsize = 4 if dtype == "float32" else 2
    raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    storage = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}[dtype]
    kv = np.frombuffer(raw, dtype=storage).reshape(shape)
    tokens = draw(st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=8))
    model = draw(st.sampled_from(["m", "org/model", "a/b/c-7B"]))
    salt = draw(st.sampled_from(["", "tenant-1"]))
    k = ObjectKey(draw(st.binary(min_size=32, max_size=32)), model, 1 << 24 | 1 << 8, 0, salt)
    return StoredChunk(
        k,
        kv,
        None if tokens is None else np.array(tokens, dtype=np.uint32),
        draw(st.integers(-1, 2**40)),
        "bfloat16" if dtype == "bfloat16" else "",
    )


@settings(max_examples=150, deadline=None)
@given(chunks())
def test_codec_round_trip(c: StoredChunk) -> None:
    data = encode_chunk(c)
    back = decode_chunk(data)
    assert_same(c, back)
    assert encode_chunk(back) == data  # canonical: re-encoding is byte-identical
    assert not back.numpy_kv().flags.writeable  # stored KV is immutable


@settings(max_examples=60, deadline=None)
@given(chunks(), st.data())
def test_codec_detects_any_flipped_byte_and_any_truncation(c: StoredChunk, data: Any) -> None:
    encoded = encode_chunk(c)
    pos = data.draw(st.integers(0, len(encoded) - 1))
    flip = data.draw(st.integers(1, 255))
    corrupt = bytearray(encoded)
    corrupt[pos] ^= flip
    with pytest.raises(ChunkDecodeError):
        decode_chunk(bytes(corrupt))
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ChunkDecodeError):
        decode_chunk(encoded[:cut])
    with pytest.raises(ChunkDecodeError):
        decode_chunk(encoded + b"\0")


@pytest.mark.parametrize("garbage", [b"", b"KVAC", b"\x00" * 64, b"hello world" * 10])
def test_codec_rejects_garbage(garbage: bytes) -> None:
    with pytest.raises(ChunkDecodeError):
        decode_chunk(garbage)
    assert issubclass(ChunkDecodeError, ValueError)


def test_node_errors_are_in_the_error_tree() -> None:
    assert issubclass(ChunkDecodeError, InvalidInput) and ChunkDecodeError.status == 400
    assert issubclass(L2Unavailable, Unavailable) and issubclass(L2Unavailable, RuntimeError)
    assert L2Unavailable.status == 503


def test_torch_tensors_are_accepted_and_bf16_round_trips_bit_exactly() -> None:
    torch = require_torch()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(*KV_SHAPE, generator=g).to(dtype)
        c = StoredChunk(key(1), t, torch.tensor([1, 2, 3]), 256)
        assert c.kv_dtype == str(dtype).removeprefix("torch.")
        assert c.nbytes == t.numel() * t.element_size()
        back = decode_chunk(encode_chunk(c))
        assert back.kv_dtype == c.kv_dtype
        restored = back.torch_kv()
        assert restored.dtype == dtype
        assert torch.equal(restored, t)
        assert back.tokens is not None and back.tokens.tolist() == [1, 2, 3]
    # bf16 decodes to a real numpy bfloat16 (ml_dtypes), with or without torch
    back = decode_chunk(encode_chunk(StoredChunk(key(1), t.to(torch.bfloat16))))
    assert back.kv.dtype.name == "bfloat16"
    # and re-encoding a decoded bf16 chunk keeps the label (L1 -> L2 after a peer fetch)
    assert decode_chunk(encode_chunk(back)).kv_dtype == "bfloat16"


def test_stored_chunk_validation() -> None:
    with pytest.raises(ValueError, match="float64"):
        StoredChunk(key(0), np.zeros(4))
    with pytest.raises(ValueError, match="bfloat16"):
        StoredChunk(key(0), np.zeros(4, dtype=np.uint16))  # bit patterns must be declared
    with pytest.raises(ValueError, match="does not match"):
        StoredChunk(key(0), np.zeros(4, dtype=np.float32), kv_dtype="bfloat16")
    with pytest.raises(ValueError, match="token_offset"):
        StoredChunk(key(0), np.zeros(4, dtype=np.float32), token_offset=-2)
    with pytest.raises(ValueError, match="outside"):
        StoredChunk(key(0), np.zeros(4, dtype=np.float32), np.array([-1]))
    with pytest.raises(TypeError):
        StoredChunk(key(0), [1.0, 2.0])
    c = StoredChunk(key(0), np.zeros(4, dtype=np.float32), [5, 6])  # type: ignore[arg-type]
    assert c.tokens is not None and c.tokens.dtype == np.uint32 and c.nbytes == 16


# -- fs ----------------------------------------------------------------------------------


def test_fs_round_trip_get_many_delete(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path / "l2")
    assert isinstance(l2, L2Backend)
    assert l2.shared is False and l2.name == "fs"
    for i in range(5):
        l2.put(chunk(i))
    assert_same(l2.get(key(3)) or pytest.fail("miss"), chunk(3))
    assert l2.get(key(99)) is None
    found = l2.get_many([key(0), key(99), key(4), key(0)])
    assert set(found) == {key(0), key(4)}
    assert_same(found[key(4)], chunk(4))
    assert l2.contains(key(1)) and not l2.contains(key(99))
    assert l2.delete(key(1)) is True
    assert l2.delete(key(1)) is False
    assert l2.get(key(1)) is None and not l2.contains(key(1))
    l2.close()


def test_fs_overwrite_replaces(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path)
    l2.put(chunk(1))
    newer = StoredChunk(key(1), np.ones(3, dtype=np.float32), None, 7)
    l2.put(newer)
    assert_same(l2.get(key(1)) or pytest.fail("miss"), newer)


def test_fs_model_names_with_slashes_and_salts_never_collide(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path)
    variants = [
        chunk(1, "org/model"),
        chunk(1, "org/model/extra"),
        chunk(1, "org"),
        chunk(1, "org/model", salt="tenant-a"),
        chunk(1, "../../escape"),
    ]
    for c in variants:
        l2.put(c)
    paths = {l2.path_for(c.key) for c in variants}
    assert len(paths) == len(variants)
    for p in paths:  # every file sits exactly two levels under the root, whatever the model
        assert p.parent.parent == tmp_path
    for c in variants:
        got = l2.get(c.key)
        assert got is not None and got.key == c.key


def test_fs_truncated_or_corrupt_final_file_is_a_miss_and_removed(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path)
    for i in range(3):
        l2.put(chunk(i))
    torn = l2.path_for(key(0))
    torn.write_bytes(torn.read_bytes()[:-100])
    flipped = l2.path_for(key(1))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    empty = l2.path_for(key(2))
    empty.write_bytes(b"")
    for i in range(3):
        assert l2.get(key(i)) is None
        assert not l2.path_for(key(i)).exists()


def test_fs_file_holding_another_keys_chunk_is_a_miss(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path)
    l2.put(chunk(1))
    target = l2.path_for(key(2))
    target.parent.mkdir(exist_ok=True)
    os.replace(l2.path_for(key(1)), target)
    assert l2.get(key(2)) is None


def test_fs_leftover_temp_files_are_ignored_and_stale_ones_swept(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path)
    l2.put(chunk(1))
    final = l2.path_for(key(2))
    final.parent.mkdir(exist_ok=True)
    # a crash mid-write leaves a partial temp file next to where key 2 would go
    stale = final.parent / ".tmp-crashed.part"
    stale.write_bytes(encode_chunk(chunk(2))[:50])
    young = final.parent / ".tmp-live-writer.part"
    young.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert l2.get(key(2)) is None and not l2.contains(key(2))
    assert l2.get(key(1)) is not None
    # a shared pool's restart sweeps temp files older than an hour, keeps young ones (another
    # node may be writing them); a private L2 sweeps them all (test_l2_bounds.py)
    FsL2(tmp_path, shared=True)
    assert not stale.exists() and young.exists()
    assert FsL2(tmp_path).get(key(1)) is not None


def test_fs_crash_before_rename_keeps_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    l2 = FsL2(tmp_path)
    l2.put(chunk(1))

    def crash(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(L2Unavailable):
        l2.put(StoredChunk(key(1), np.ones(3, dtype=np.float32)))
    monkeypatch.undo()
    assert_same(l2.get(key(1)) or pytest.fail("miss"), chunk(1))
    assert list(tmp_path.glob("*/.tmp-*")) == []


def test_fs_write_failure_raises_l2_unavailable(tmp_path: Path) -> None:
    l2 = FsL2(tmp_path)
    blocker = l2.path_for(key(5)).parent
    blocker.write_bytes(b"not a directory")
    with pytest.raises(L2Unavailable):
        l2.put(chunk(5))
    assert l2.get(key(5)) is None


# -- redis -------------------------------------------------------------------------------


@pytest.fixture
def redis_l2(redis_server: RedisServer) -> Any:
    l2 = RedisL2(redis_server.url, prefix=f"test:{uuid.uuid4().hex}:")
    yield l2
    l2.close()


def test_redis_round_trip_get_many_delete(redis_l2: RedisL2) -> None:
    assert isinstance(redis_l2, L2Backend)
    assert redis_l2.shared is True and redis_l2.name == "redis"
    for i in range(0, 150, 2):  # more than one MGET batch
        redis_l2.put(chunk(i))
    assert_same(redis_l2.get(key(4)) or pytest.fail("miss"), chunk(4))
    assert redis_l2.get(key(5)) is None
    found = redis_l2.get_many([key(i) for i in range(150)])
    assert set(found) == {key(i) for i in range(0, 150, 2)}
    assert_same(found[key(148)], chunk(148))
    assert redis_l2.contains(key(2)) and not redis_l2.contains(key(3))
    assert redis_l2.delete(key(2)) is True
    assert redis_l2.delete(key(2)) is False
    assert redis_l2.get(key(2)) is None


def test_redis_keys_are_full_key_digests_and_ttl(redis_server: RedisServer) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    l2 = RedisL2(redis_server.url, prefix=prefix, ttl_seconds=600)
    a, b = chunk(1, "org/model"), chunk(1, "org/model", salt="other-tenant")
    l2.put(a)
    l2.put(b)
    assert l2.redis_key(a.key) == prefix + key_digest(a.key) != l2.redis_key(b.key)
    assert (l2.get(a.key) or pytest.fail("miss")).key == a.key
    assert (l2.get(b.key) or pytest.fail("miss")).key == b.key
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < int(raw.ttl(l2.redis_key(a.key))) <= 600
    raw.close()
    l2.close()


def test_redis_corrupt_value_is_a_miss(redis_server: RedisServer, redis_l2: RedisL2) -> None:
    redis_l2.put(chunk(1))
    raw = redis.Redis.from_url(redis_server.url)
    good = raw.get(redis_l2.redis_key(key(1)))
    assert isinstance(good, bytes)
    raw.set(redis_l2.redis_key(key(1)), good[:-1])
    raw.set(redis_l2.redis_key(key(2)), b"garbage")
    raw.close()
    assert redis_l2.get(key(1)) is None
    assert redis_l2.get_many([key(1), key(2)]) == {}


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DroppingServer:
    """A "Redis" that accepts every connection and closes it at once (a server going down),
    counting the connections: the cost of a dead L2 in attempts, not in wall-clock time."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def backoff_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every sleep redis-py's retry takes between attempts (RedisL2 must take none)."""
    import redis.retry

    sleeps: list[float] = []
    monkeypatch.setattr(redis.retry, "sleep", sleeps.append)
    return sleeps


def _dead_l2_calls(l2: RedisL2) -> int:
    """Every operation against an unreachable L2: reads miss, writes raise. Returns the count."""
    assert l2.get(key(1)) is None
    assert l2.get_many([key(1), key(2)]) == {}
    assert l2.contains(key(1)) is False
    with pytest.raises(L2Unavailable):
        l2.put(chunk(1))
    with pytest.raises(L2Unavailable):
        l2.delete(key(1))
    return 5


def test_redis_unreachable_reads_miss_writes_raise(backoff_sleeps: list[float]) -> None:
    l2 = RedisL2(f"redis://127.0.0.1:{_dead_port()}/0")
    _dead_l2_calls(l2)
    assert backoff_sleeps == []  # a dead L2 costs a refused connect per attempt, no waiting
    l2.close()


def test_a_dead_l2_costs_at_most_two_attempts_per_call(backoff_sleeps: list[float]) -> None:
    """One immediate retry (it replaces a connection a Redis restart killed), never a loop."""
    server = DroppingServer()
    try:
        l2 = RedisL2(f"redis://127.0.0.1:{server.port}/0")
        calls = _dead_l2_calls(l2)
        l2.close()
        assert calls <= server.accepted <= 2 * calls
        assert backoff_sleeps == []
    finally:
        server.close()


def test_redis_restart(
    redis_server: RedisServer, redis_l2: RedisL2, backoff_sleeps: list[float]
) -> None:
    redis_l2.put(chunk(1))
    assert redis_l2.get(key(1)) is not None
    redis_server.stop()
    try:
        assert redis_l2.get(key(1)) is None
        assert redis_l2.get_many([key(1)]) == {}
        assert redis_l2.contains(key(1)) is False
        with pytest.raises(L2Unavailable):
            redis_l2.put(chunk(2))
        assert backoff_sleeps == []  # a dead L2 costs milliseconds, not a hang
    finally:
        redis_server.start()
    # the same RedisL2 object recovers on its own (AOF kept key 1 across the restart)
    assert wait_for(lambda: redis_l2.get(key(1)) is not None, timeout=10)
    redis_l2.put(chunk(2))
    assert set(redis_l2.get_many([key(1), key(2)])) == {key(1), key(2)}
