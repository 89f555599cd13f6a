"""bfloat16 KV everywhere a dtype is accepted (issue 10, item 4).

bf16 is the dtype of most served models, and numpy has none of its own: ``ml_dtypes`` (a kvatlas
dependency) gives it one, so a bf16 chunk is a real ``ml_dtypes.bfloat16`` array in every tier
and on every wire, with or without torch. In process: the codec, both L2 backends, raw bit
patterns, torch tensors (zero-copy) and re-RoPE against the torch path. Across processes: real
``kvatlas node`` processes over HTTP store bf16 KV and read it back from L1 through a peer, from
an ``fs`` L2, from a Redis L2, and re-RoPE'd through blend retrieval -- once with torch
importable and once with ``import torch`` failing in the node processes (a ``sitecustomize``
shim written to the test's tmp dir, which also reports at exit that torch never loaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import redis

from kvatlas.coordinator.server import free_port
from kvatlas.keys import ObjectKey
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l2 import FsL2, RedisL2
from kvatlas.node.rope import rerope_k
from kvatlas.node.segments import Segment
from kvatlas.node.stored_chunk import StoredChunk, decode_chunk, encode_chunk
from kvatlas.node.toy_model import ToyRopeModel, rope_at_positions
from kvatlas.processes import spawn_service, spawn_services, stop
from tests.conftest import RedisServer, wait_for
from tests.torch_support import require_torch

BF16 = np.dtype(ml_dtypes.bfloat16)
C = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=C, dtype="bfloat16")
BF16_HALF_ULP = 2.0**-8  # bf16 keeps 8 significant bits: one rounding is <= 2^-8 relative


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "toy", 1 << 24 | 1 << 8, 0, "")


def bits(kv: Any) -> np.ndarray[Any, Any]:
    """bf16 values as their bit patterns: equality of these is bit-exact equality."""
    arr = np.asarray(kv)
    assert arr.dtype == BF16, arr.dtype
    return arr.view(np.uint16)


def bf16_chunk(seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(LAYOUT.shape).astype(np.float32).astype(BF16)


def assert_rerope_within_bf16_rounding(
    got: Any, stored: np.ndarray[Any, Any], delta: int, layout: KVLayout = LAYOUT
) -> None:
    """``got`` is ``stored`` with K moved by ``delta``: the toy model's float64 complex-number
    RoPE (independent of ``kvatlas.node.rope``) of the stored values, within one bf16 rounding
    (plus fp32 arithmetic noise); V is untouched bit for bit."""
    got = np.asarray(got)
    assert got.dtype == BF16 and got.shape == stored.shape
    k = stored[:, 0].astype(np.float64)
    want = rope_at_positions(k, np.full(stored.shape[2], delta), layout)
    err = np.abs(got[:, 0].astype(np.float64) - want)
    bound = BF16_HALF_ULP * np.abs(want) + 1e-6 * float(np.abs(k).max())
    assert (err <= bound).all(), float((err - bound).max())
    assert not np.array_equal(bits(got[:, 0]), bits(stored[:, 0]))  # it did move
    assert np.array_equal(bits(got[:, 1]), bits(stored[:, 1]))


# ---------------------------------------------------------------- in process


def test_layout_numpy_dtype_is_a_real_bfloat16() -> None:
    assert LAYOUT.numpy_dtype() == BF16


def test_raw_bit_patterns_declared_bfloat16_become_a_bfloat16_view() -> None:
    kv = bf16_chunk(1)
    raw = kv.view(np.uint16)
    c = StoredChunk(key(1), raw, kv_dtype="bfloat16")
    assert c.kv_dtype == "bfloat16" and c.kv.dtype == BF16
    assert np.shares_memory(c.kv, raw)  # a view, not a copy
    assert_rerope_within_bf16_rounding(rerope_k(c.kv, LAYOUT, 0, 100), kv, 100)


def test_cache_node_takes_bf16_arrays_and_bit_patterns_and_refuses_another_dtype() -> None:
    node = CacheNode(NodeConfig(num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=C,
                                dtype="bfloat16"), instance_id="n1")  # fmt: skip
    kv = [bf16_chunk(i) for i in range(2)]
    tokens = np.arange(2 * C, dtype=np.uint32)
    # a real bf16 array and raw bit patterns (the node's layout declares what they are)
    assert node.store(node.tracker(token_ids=tokens), [kv[0], kv[1].view(np.uint16)]) == 2
    got = node.retrieve(node.tracker(token_ids=tokens))
    assert got.hit_tokens == 2 * C
    for want, have in zip(kv, got.kv, strict=True):
        assert np.array_equal(bits(have), bits(want))
    with pytest.raises(ValueError, match="bfloat16"):
        node.store(node.tracker(token_ids=tokens + 1), [kv[0].astype(np.float32)])


@pytest.mark.parametrize("via", ["codec", "l2-fs", "l2-redis"])
def test_bf16_round_trips_to_a_bfloat16_array(
    via: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    kv = bf16_chunk(2)
    tokens = np.arange(C, dtype=np.uint32)
    c = StoredChunk(key(2), kv, tokens, 3 * C)
    if via == "codec":
        back = decode_chunk(encode_chunk(c))
    else:
        l2 = FsL2(tmp_path) if via == "l2-fs" else RedisL2(redis_server.url, prefix=f"{tmp_path}:")
        try:
            l2.put(c)
            got = l2.get(c.key)
        finally:
            l2.close()
        assert got is not None
        back = got
    assert back.kv_dtype == "bfloat16" and back.kv.dtype == BF16
    assert np.array_equal(bits(back.kv), bits(kv))
    assert back.token_offset == 3 * C
    assert_rerope_within_bf16_rounding(rerope_k(back.kv, LAYOUT, 3 * C, 7), kv, 7 - 3 * C)


def test_torch_bf16_tensors_convert_without_a_copy() -> None:
    torch = require_torch()
    t = torch.from_numpy(bf16_chunk(3).astype(np.float32)).to(torch.bfloat16)
    c = StoredChunk(key(3), t)
    assert c.kv is t  # L1 keeps what the engine handed over
    arr = c.numpy_kv()
    assert arr.dtype == BF16
    assert arr.__array_interface__["data"][0] == t.data_ptr()  # same memory
    assert np.array_equal(arr.astype(np.float32), t.float().numpy())
    back = decode_chunk(encode_chunk(c))
    assert back.kv.dtype == BF16
    restored = back.torch_kv()
    assert restored.dtype == torch.bfloat16 and torch.equal(restored, t)
    # a numpy bf16 chunk also becomes a torch view of the same bytes
    own = StoredChunk(key(4), bf16_chunk(4))
    view = own.torch_kv()
    assert view.dtype == torch.bfloat16 and view.data_ptr() == own.kv.__array_interface__["data"][0]


def test_rerope_numpy_bf16_equals_the_torch_path() -> None:
    """The numpy path (no torch needed) and the torch path compute the same fp32 rotation and
    round once to bf16: the results agree within one bf16 rounding (in practice bit for bit)."""
    torch = require_torch()
    for style in ("neox", "gptj"):
        layout = KVLayout(2, 2, 64, chunk_size=32, dtype="bfloat16", rope_style=style)
        model = ToyRopeModel(layout)
        tokens = np.random.default_rng(5).integers(0, 1000, 32)
        stored = model.kv_chunk(tokens, 40)
        assert stored.dtype == BF16
        for cur in (0, 41, 70_000):
            via_numpy = rerope_k(stored, layout, 40, cur)
            via_torch = rerope_k(torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16),
                                 layout, 40, cur)  # fmt: skip
            assert via_torch.dtype == torch.bfloat16
            a = via_numpy.astype(np.float64)
            b = via_torch.double().numpy()
            assert (np.abs(a - b) <= 2 * BF16_HALF_ULP * np.abs(b)).all(), (style, cur)
            assert_rerope_within_bf16_rounding(via_numpy, stored, cur - 40, layout)


def test_the_client_does_not_load_ml_dtypes() -> None:
    probe = "import sys, kvatlas.client\nprint('ml_dtypes' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- node processes

# Written into the test's tmp dir and put on the node processes' PYTHONPATH: Python imports
# ``sitecustomize`` at start-up. It makes the modules named in BF16TEST_BLOCK fail to import,
# and at exit writes what the process had loaded -- the proof that torch never ran.
SITECUSTOMIZE = """
import atexit, importlib.util, json, os, sys

BLOCKED = tuple(m for m in os.environ.get("BF16TEST_BLOCK", "").split(",") if m)
ATTEMPTS = []


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            ATTEMPTS.append(name)
            raise ImportError(f"{name} is blocked in this process by the bf16 test")
        return None


if BLOCKED:
    sys.meta_path.insert(0, Blocker())


def report():
    attempts = list(ATTEMPTS)
    try:
        importable = importlib.util.find_spec("torch") is not None
    except ImportError:
        importable = False
    loaded = sorted(m for m in ("torch", "ml_dtypes") if m in sys.modules)
    path = os.path.join(os.environ["BF16TEST_PROBE_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"torch_importable": importable, "loaded": loaded, "attempts": attempts}, f)


atexit.register(report)
"""

L1_CHUNKS = 3  # each node's L1 holds three chunks: a fourth evicts the oldest (to its L2)
NODE_FLAGS = [
    "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
    "--chunk-size", str(C), "--dtype", "bfloat16", "--log-level", "warning",
    "--l1-bytes", str(L1_CHUNKS * LAYOUT.chunk_bytes), "--coordinator-blend-timeout", "20",
]  # fmt: skip


@contextmanager
def bf16_fleet(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, *, block_torch: bool
) -> Iterator[tuple[NodeEngineClient, NodeEngineClient, list[subprocess.Popen[bytes]], Path]]:
    """A coordinator and two bf16 nodes: A with an ``fs`` L2, B with a Redis L2."""
    shim, probes = tmp_path / "shim", tmp_path / "probes"
    shim.mkdir()
    probes.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shim), inherited])))
    monkeypatch.setenv("BF16TEST_PROBE_DIR", str(probes))
    monkeypatch.setenv("BF16TEST_BLOCK", "torch" if block_torch else "")
    coord_port, a_port, b_port = free_port(), free_port(), free_port()
    coord = f"http://127.0.0.1:{coord_port}"
    procs: list[subprocess.Popen[bytes]] = []
    clients: list[NodeEngineClient] = []
    try:
        procs.append(spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(coord_port), "--chunk-size",
             str(C), "--enable-blend-lookup", "--log-level", "warning"], coord,
        ))  # fmt: skip
        tiers = {
            "a": ["--l2", "fs", "--l2-path", str(tmp_path / "l2-a")],
            "b": ["--l2", "redis", "--l2-redis-url", redis_url],
        }
        nodes = {"a": a_port, "b": b_port}
        procs += spawn_services([
            (["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", f"node-{name}",
              "--coordinator-url", coord, "--coordinator-event-reporting", *NODE_FLAGS,
              *tiers[name]], f"http://127.0.0.1:{port}")
            for name, port in nodes.items()
        ])  # fmt: skip
        clients += [NodeEngineClient(f"http://127.0.0.1:{port}", LAYOUT) for port in nodes.values()]
        yield clients[0], clients[1], procs, probes
    finally:
        for client in clients:
            client.close()
        stop(procs)


def tokens(rng: np.random.Generator, n: int) -> np.ndarray[Any, Any]:
    return rng.integers(0, 50_000, n).astype(np.uint32)


def blend_at_new_offset(
    node: NodeEngineClient, doc: np.ndarray[Any, Any], q: int, rid: str, rng: np.random.Generator
) -> tuple[list[tuple[Segment, Any]], dict[str, int]]:
    """Blend-retrieve ``doc``'s chunks placed at offset ``q`` of a new query."""
    query = np.concatenate([tokens(rng, q), doc, tokens(rng, 5)])
    answers: list[list[Segment] | None] = []
    assert wait_for(
        lambda: answers.append(node.blend_lookup(query, rid)) or answers[-1] is not None,
        timeout=60,
    )
    segments = answers[-1]
    assert segments is not None and len(segments) == len(doc) // C, segments
    got = node.blend_retrieve(query, rid, segments)
    assert got["misses"] == [], got["misses"]
    return got["parts"], dict(got["sources"])


REDIS_DB = {"importable": 7, "blocked": 8}


@pytest.mark.parametrize("torch_in_nodes", ["importable", "blocked"])
def test_bf16_through_node_processes(
    torch_in_nodes: str,
    tmp_path: Path,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = require_torch() if torch_in_nodes == "importable" else None
    rng = np.random.default_rng(11)
    doc1, doc2 = tokens(rng, 3 * C), tokens(rng, 3 * C)
    model = ToyRopeModel(LAYOUT)
    kv1, kv2 = model.kv_chunks(doc1), model.kv_chunks(doc2)  # KV stored at positions 0, C, 2C
    # with torch, the engine hands over torch bf16 tensors (converted by the client)
    as_engine = (
        (lambda kv: [torch.from_numpy(k.view(np.int16)).view(torch.bfloat16) for k in kv])
        if torch is not None
        else list
    )

    def check_parts(parts: list[tuple[Segment, Any]], stored: list[Any]) -> None:
        for seg, kv in parts:
            i = seg.old_st // C
            assert_rerope_within_bf16_rounding(kv, stored[i], seg.chunk_cur_st - i * C)
            if torch is not None:  # the torch path of re-RoPE gives the same values
                t = torch.from_numpy(stored[i].view(np.int16)).view(torch.bfloat16)
                want = rerope_k(t, LAYOUT, i * C, seg.chunk_cur_st).double().numpy()
                err = np.abs(np.asarray(kv).astype(np.float64) - want)
                assert (err <= 2 * BF16_HALF_ULP * np.abs(want)).all()

    # a Redis database of its own, empty: what B reads back from its L2 is what B wrote now
    redis_url = f"{redis_server.url.rpartition('/')[0]}/{REDIS_DB[torch_in_nodes]}"
    redis.Redis.from_url(redis_url).flushdb()
    with bf16_fleet(tmp_path, redis_url, monkeypatch, block_torch=torch_in_nodes == "blocked") as (
        a,
        b,
        procs,
        probes,
    ):
        assert a.store(doc1, as_engine(kv1), request_id="store-1") == 3  # was: 500

        # B: peer fetch from A's L1, as stored and re-RoPE'd to a new offset
        assert wait_for(lambda: b.lookup(doc1) == 3 * C, timeout=60)
        got, sources = b.retrieve(doc1, request_id="peer-1")
        assert sources == {"peer_l1": 3}
        assert [bits(k).tobytes() for k in got] == [bits(k).tobytes() for k in kv1]
        parts, sources = blend_at_new_offset(b, doc1, 21, "blend-peer", rng)
        assert sources == {"peer_l1": 3}
        check_parts(parts, kv1)

        # A: evicted from L1 by three newer chunks, read back from its fs L2
        assert a.store(tokens(rng, 3 * C), model.kv_chunks(tokens(rng, 3 * C))) == 3
        got, sources = a.retrieve(doc1, request_id="fs-1")
        assert sources == {"l2": 3}
        assert [bits(k).tobytes() for k in got] == [bits(k).tobytes() for k in kv1]
        parts, sources = blend_at_new_offset(a, doc1, 1000, "blend-fs", rng)
        assert sources == {"l2": 3}
        check_parts(parts, kv1)

        # B: its own chunks, evicted from L1, read back from the Redis L2
        assert b.store(doc2, as_engine(kv2), request_id="store-2") == 3
        assert b.store(tokens(rng, 3 * C), model.kv_chunks(tokens(rng, 3 * C))) == 3
        got, sources = b.retrieve(doc2, request_id="redis-1")
        assert sources == {"l2": 3}
        assert [bits(k).tobytes() for k in got] == [bits(k).tobytes() for k in kv2]
        parts, sources = blend_at_new_offset(b, doc2, 7, "blend-redis", rng)
        assert sources == {"l2": 3}
        check_parts(parts, kv2)

        stop(procs)  # a graceful exit runs the probes' atexit reports
        reports = [json.loads((probes / f"{p.pid}.json").read_text()) for p in procs[1:]]
    for report in reports:
        assert "torch" not in report["loaded"], report  # the node never needs torch
        assert report["torch_importable"] is (torch_in_nodes == "importable"), report
        assert "ml_dtypes" in report["loaded"], report
