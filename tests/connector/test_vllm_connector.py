"""kvatlas as vLLM's KV connector, driven in vLLM's call order (tests/connector/harness.py)
with vLLM 0.33's own classes, against real node and coordinator processes over HTTP.

Under ``CI=true`` these run (``tests/vllm_support.py``): vLLM is installed by ``make test``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.node.rope import rerope_k
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service, spawn_services, stop
from tests.conftest import HTTP, wait_for
from tests.vllm_support import require_vllm

C = 16
HEADERS = {"Accept": "application/json"}
TINY_LLAMA = {  # the engine's model: what both the nodes (--hf-config) and the engine read
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "rope_theta": 10000.0, "torch_dtype": "float32", "vocab_size": 512,
}  # fmt: skip


def tiny_node(
    hf_config: Path, port: int, chunk: int = C, timeout: float = 60.0, model_name: str = "tiny",
    config: Mapping[str, object] = TINY_LLAMA,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """A lone ``kvatlas node`` of :data:`TINY_LLAMA` (or ``config``) on ``port`` (no
    coordinator, no L2); ``hf_config``: a directory, its ``config.json`` written here."""
    (hf_config / "config.json").write_text(json.dumps(config))
    return spawn_service(
        ["-m", "kvatlas.cli", "node", "--port", str(port), "--hf-config", str(hf_config),
         "--model-name", model_name, "--chunk-size", str(chunk), "--l2", "none",
         "--log-level", "warning"],
        f"http://127.0.0.1:{port}", timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    tmp = tmp_path_factory.mktemp("fleet")
    (tmp / "config.json").write_text(json.dumps(TINY_LLAMA))
    coord = f"http://127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", coord.rsplit(":", 1)[1],
             "--chunk-size", str(C), "--enable-blend-lookup", "--log-level", "warning"], coord,
        ))  # fmt: skip
        urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("a", "b")}
        procs += spawn_services([
            (["-m", "kvatlas.cli", "node", "--port", url.rsplit(":", 1)[1],
              "--instance-id", f"node-{name}", "--hf-config", str(tmp), "--model-name", "tiny",
              "--chunk-size", str(C), "--l2", "none", "--coordinator-url", coord,
              "--coordinator-event-reporting", "--coordinator-blend-timeout", "20",
              "--log-level", "warning"], url)
            for name, url in urls.items()
        ])  # fmt: skip
        yield {"coordinator": coord, "hf_config": str(tmp), **urls}
    finally:
        stop(procs)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128_256, n)  # a Llama-3-sized vocabulary


def fresh(model: ToyRopeModel, toks: np.ndarray, start: int = 0) -> np.ndarray:
    return model.kv_chunk(np.asarray(toks), start)  # [L, 2, T, H, D]


def coordinator_keys(fleet: dict[str, str]) -> int:
    return int(HTTP.get(f"{fleet['coordinator']}/directory/stats").json()["keys"])


def test_cold_request_stores_and_same_prefix_loads_bit_exactly(
    fleet: dict[str, str], model: ToyRopeModel
) -> None:
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model)
    prefix = tokens(1, 2 * C)
    cold = engine.run(make_request("cold", [*prefix, *tokens(2, 9)]), budget=12)  # chunked prefill
    assert cold.matched == 0 and engine.load_errors == [set()] * 4
    stats = engine.worker.worker.stats()
    assert stats["chunks_saved"] == 2 and stats["node_failures"] == {}
    warm = engine.run(make_request("warm", [*prefix, *tokens(3, 5)]))
    assert warm.matched == 2 * C
    assert set(warm.block_ids).isdisjoint(cold.block_ids)
    loaded = warm.stack().numpy()
    want = fresh(model, prefix)
    assert loaded.dtype == want.dtype and np.array_equal(loaded, want)  # bit for bit
    assert engine.load_errors[-1] == set()
    # a prompt of exactly the stored chunks: vLLM must still compute its last token
    whole = engine.run(make_request("whole", list(prefix)))
    assert whole.matched == 2 * C - 1
    engine.close()


def node_prefix_hits(url: str) -> float:
    """The node's ``kvatlas_node_hit_tokens_total{kind="prefix"}``: tokens its retrievals sent."""
    import re

    found = re.search(r'^kvatlas_node_hit_tokens_total\{kind="prefix"\} ([0-9.e+]+)$',
                      HTTP.get(f"{url}/metrics").text, re.M)  # fmt: skip
    return float(found[1]) if found else 0.0


def test_the_chunks_vllm_holds_itself_are_not_retrieved(
    fleet: dict[str, str], model: ToyRopeModel
) -> None:
    """vLLM's own prefix cache holds a prompt's first chunk: the connector claims and loads the
    next two, and the node sends those two only (``first_chunk``). The old worker retrieved
    every leading chunk and dropped the ones vLLM held: here a third of the transfer, in a
    long conversation nearly all of it."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model)
    prefix = tokens(41, 3 * C)
    engine.run(make_request("cold-held", [*prefix, *tokens(42, 5)]))
    before = node_prefix_hits(fleet["a"])
    warm = engine.run(make_request("warm-held", [*prefix, *tokens(43, 5)]), local=C)
    assert warm.matched == 2 * C
    assert np.array_equal(warm.stack().numpy(), fresh(model, prefix))  # held + loaded rows
    assert engine.load_errors[-1] == set()
    assert node_prefix_hits(fleet["a"]) - before == 2 * C  # the old worker: 3 chunks
    engine.close()


def test_packing_split_last_round_trips(fleet: dict[str, str], model: ToyRopeModel) -> None:
    """The other K/V packing (FlashAttention's cell layout): store and load through it."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model, packing="split_last")
    prompt = [*tokens(10, C), *tokens(11, 3)]
    assert engine.run(make_request("p1", prompt)).matched == 0
    again = engine.run(make_request("p2", prompt))
    assert again.matched == C and np.array_equal(again.stack().numpy(), fresh(model, prompt[:C]))
    engine.close()


def test_fragment_reuse_with_rerope(fleet: dict[str, str], model: ToyRopeModel) -> None:
    """CacheBlend-style: a chunk stored at 2C continues another request's prefix at C. Its K
    arrives re-RoPE'd to its new position: equal to the toy model's K computed fresh there
    (a brute-force RoPE at absolute positions) and to the node's own re-RoPE of the stored
    chunk; V is position-free and equal bit for bit. Nothing from the fragment on is stored."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model, blend=True)
    system, doc1, doc2 = tokens(20, C), tokens(21, C), tokens(22, C)
    engine.run(make_request("rag-1", [*system, *doc1, *doc2, *tokens(23, 4)]))
    query = [*system, *doc2, *tokens(24, 6)]
    got = engine.run(make_request("rag-2", query))
    assert got.matched == 2 * C
    loaded = got.stack().numpy()
    assert np.array_equal(loaded[:, :, :C], fresh(model, system))  # the exact prefix
    moved = loaded[:, :, C:]
    np.testing.assert_allclose(moved[:, 0], fresh(model, doc2, C)[:, 0], atol=1e-5)
    assert np.array_equal(moved[:, 1], fresh(model, doc2, 2 * C)[:, 1])
    stored = fresh(model, doc2, 2 * C)  # the chunk as stored: [L, 2, C, H, D]
    by_node = rerope_k(stored, model.layout, old_st=2 * C, cur_st=C)
    np.testing.assert_allclose(moved[:, 0], np.asarray(by_node)[:, 0], atol=1e-6)
    # approximate KV never reaches the node under an exact key: only the system chunk is held
    plain = Engine.start(fleet["a"], model)
    assert plain.match(make_request("probe", query)) == C
    plain.close()
    engine.close()


def test_fragment_after_a_gap_is_not_claimed(fleet: dict[str, str], model: ToyRopeModel) -> None:
    """vLLM computes every token after its computed prefix: a fragment behind uncached tokens
    cannot be used (claimed tokens are one contiguous run)."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model, blend=True)
    doc = tokens(30, C)
    engine.run(make_request("g1", [*doc, *tokens(31, 2)]))
    gap = engine.run(make_request("g2", [*tokens(32, 5), *doc, *tokens(33, 2)]))
    assert gap.matched == 0
    engine.close()


def test_a_fragment_continuing_vllms_own_prefix_is_claimed(
    fleet: dict[str, str], model: ToyRopeModel
) -> None:
    """vLLM's own prefix cache holds the query's first 2C tokens, the node none of them: a
    fragment at 2C continues the run vLLM has, and is claimed (C). The run started at the
    node's prefix hit (0), and the blend lookup was asked from there, so the fragment "followed
    a gap" that was none. Control: the node holding those 2C itself claims 3C."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model, blend=True)
    doc, a, b = tokens(130, C), tokens(131, C), tokens(132, C)
    engine.run(make_request("doc-at-c", [*tokens(133, C), *doc, *tokens(134, 3)]))
    query = [*a, *b, *doc, *tokens(135, 5)]
    assert engine.match(make_request("q-local", query), local=2 * C) == C
    got = engine.run(make_request("q-local-run", query), local=2 * C)
    assert got.matched == C and engine.load_errors[-1] == set()
    engine.run(make_request("stores-ab", [*a, *b, *tokens(136, 3)]))
    assert engine.match(make_request("q-node", query)) == 3 * C
    engine.close()


def test_prefix_stored_by_another_node(fleet: dict[str, str], model: ToyRopeModel) -> None:
    """Engine A stores through node A; engine B, on node B, finds the prefix through the
    fleet (coordinator) and loads it from node A's L1 (peer), bit for bit."""
    from tests.connector.harness import Engine, make_request

    on_a, on_b = Engine.start(fleet["a"], model), Engine.start(fleet["b"], model)
    prefix = tokens(40, 3 * C)
    before = coordinator_keys(fleet)
    on_a.run(make_request("x1", [*prefix, *tokens(41, 3)]))
    assert wait_for(lambda: coordinator_keys(fleet) >= before + 3, timeout=20)
    got = on_b.run(make_request("x2", [*prefix, *tokens(42, 7)]))
    assert got.matched == 3 * C
    assert np.array_equal(got.stack().numpy(), fresh(model, prefix))
    stats = httpx.get(f"{fleet['b']}/engine/stats", headers={"Accept": "application/json"}).json()
    assert stats["l1_chunks"] == 0  # node B holds none of it: the KV came through the fleet
    on_a.close()
    on_b.close()


def test_other_salt_or_image_does_not_hit(fleet: dict[str, str], model: ToyRopeModel) -> None:
    """Negative controls: the same token ids under another cache salt, or with another image
    in a placeholder span (or an image where the stored request had none), match nothing."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model, blend=True)
    prompt = [*tokens(50, 2 * C), *tokens(51, 3)]
    engine.run(make_request("s1", prompt, salt="tenant-a", images=[("img-1", 4, 6)]))

    def matched(**kw: object) -> int | None:
        return engine.match(make_request("probe", prompt, **kw))  # type: ignore[arg-type]

    assert matched(salt="tenant-a", images=[("img-1", 4, 6)]) == 2 * C  # the positive control
    assert matched(salt="tenant-b", images=[("img-1", 4, 6)]) == 0
    assert matched(salt=None, images=[("img-1", 4, 6)]) == 0
    assert matched(salt="tenant-a", images=[("img-2", 4, 6)]) == 0
    assert matched(salt="tenant-a") == 0
    engine.close()


@pytest.mark.parametrize(
    "image", [(4, 6), (2 * C + 2, 4), (2 * C - 3, 6)], ids=["inside", "after", "straddling"]
)
def test_an_image_past_the_stored_chunks_is_stored_under_its_keys(
    fleet: dict[str, str], model: ToyRopeModel, image: tuple[int, int]
) -> None:
    """Two full chunks and 9 tokens, an image inside the chunks, after them or across their
    end: both chunks are stored, the same image and text hit them, and another image misses
    every chunk holding or following any part of its span (chunks before it hit: their KV
    does not depend on it). The store sent the stored chunks' tokens only with every image,
    and the node refused a span past those tokens as outside the prompt: nothing stored."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model)
    offset, length = image
    prompt = [*tokens(90 + offset, 2 * C), *tokens(91 + offset, 9)]
    engine.run(make_request(f"img-cold-{offset}", prompt, images=[("img-1", offset, length)]))
    assert engine.worker.worker.stats()["chunks_saved"] == 2
    same = make_request(f"img-same-{offset}", prompt, images=[("img-1", offset, length)])
    assert engine.match(same) == 2 * C
    other = make_request(f"img-other-{offset}", prompt, images=[("img-2", offset, length)])
    assert engine.match(other) == min(offset // C, 2) * C
    engine.close()


def test_a_node_that_lost_the_chunks_is_a_load_error(
    fleet: dict[str, str], model: ToyRopeModel
) -> None:
    """Between the scheduler's lookup and the worker's load the node can lose a chunk: the
    rows are not faked, their blocks are reported and vLLM recomputes them."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model)
    prompt = [*tokens(60, 2 * C), *tokens(61, 3)]
    engine.run(make_request("l1", prompt))
    port = free_port()  # a node outside the fleet: it cannot have them
    lone = tiny_node(Path(fleet["hf_config"]), port)
    other = Engine.start(f"http://127.0.0.1:{port}", model)
    # A's scheduler plans the load, a worker whose node lacks the chunks carries it out
    mixed = Engine(engine.scheduler, other.worker, other.pages, model, "split_tokens")
    got = mixed.run(make_request("l2", [*prompt[: 2 * C], *tokens(62, 3)]))
    assert got.matched == 2 * C
    assert mixed.load_errors[0] == set(got.block_ids[: 2 * C // 8])  # every loaded block
    assert np.isnan(got.stack().numpy()).all()  # nothing faked into them
    engine.close()
    other.close()
    stop([lone])


def test_no_store_from_a_step_whose_load_failed(fleet: dict[str, str], model: ToyRopeModel) -> None:
    """A chunk computed in the step whose load failed attended to rows that were never written
    (left as they were: NaN here, another request's KV in a real cache): its KV must not reach
    the node under its exact prefix key (vLLM recomputes from the failed block; the chunk is a
    miss, not wrong KV). The toy model's KV ignores context, so what is checked is the send:
    the old code stored chunk 2 in that step. Positive control: the same step with its load
    served stores it."""
    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model)
    head = tokens(70, 2 * C)
    engine.run(make_request("f1", [*head, *tokens(71, 3)]))
    port = free_port()  # a node outside the fleet: it cannot have the head
    url = f"http://127.0.0.1:{port}"
    lone = tiny_node(Path(fleet["hf_config"]), port)
    try:
        other = Engine.start(url, model)
        mixed = Engine(engine.scheduler, other.worker, other.pages, model, "split_tokens")
        got = mixed.run(make_request("f2", [*head, *tokens(72, C + 3)]))  # one step: 2C loaded
        assert got.matched == 2 * C and mixed.load_errors[0]  # ... and failed
        stats = other.worker.worker.stats()
        assert stats["chunks_saved"] == 0 and stats["stores_dropped_load_error"] == 1
        assert httpx.get(f"{url}/engine/stats", headers=HEADERS).json()["l1_chunks"] == 0
        saved = engine.worker.worker.stats()["chunks_saved"]
        ok = engine.run(make_request("f3", [*head, *tokens(73, C + 3)]))
        assert ok.matched == 2 * C and engine.load_errors[-1] == set()
        assert engine.worker.worker.stats()["chunks_saved"] == saved + 1
        other.close()
    finally:
        engine.close()
        stop([lone])


def test_a_streaming_sessions_later_turns_are_stored(
    fleet: dict[str, str], model: ToyRopeModel
) -> None:
    """vLLM 0.33's streaming-input session (``Scheduler._update_request_as_session``) appends
    the next turn to ``prompt_token_ids`` (``num_prompt_tokens`` grows) and schedules the same
    request again as new, from ``num_computed_tokens`` (no lookup; ``update_state_after_alloc``
    with 0 external tokens; no ``request_finished`` in between). The second turn's complete
    prompt chunks are stored, and a request with the whole history hits them; the first turn's
    prompt length stayed the store limit, so no later turn was ever stored."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from tests.connector.harness import BLOCK, Engine, make_request

    engine = Engine.start(fleet["a"], model)
    turn1, turn2 = tokens(86, 2 * C + 3).tolist(), tokens(87, 2 * C).tolist()
    request = make_request("session", turn1)
    block_ids = [engine.free.pop() for _ in range(-(-(len(turn1) + len(turn2)) // BLOCK))]

    def allocated(n_tokens: int) -> KVCacheBlocks:
        return KVCacheBlocks((tuple(KVCacheBlock(b) for b in block_ids[: -(-n_tokens // BLOCK)]),))

    assert engine.match(request) == 0
    engine.scheduler.update_state_after_alloc(request, allocated(len(turn1)), 0)
    engine.step(request, block_ids, 0, len(turn1), new=True)
    assert engine.worker.worker.stats()["chunks_saved"] == 2
    request.prompt_token_ids.extend(turn2)  # as _update_request_as_session does
    request._all_token_ids.extend(turn2)
    request.num_prompt_tokens = len(request.prompt_token_ids)
    engine.scheduler.update_state_after_alloc(request, allocated(request.num_tokens), 0)
    engine.step(request, block_ids, len(turn1), len(turn2), new=True)
    assert engine.worker.worker.stats()["chunks_saved"] == 4  # chunks 2 and 3: complete now
    history = make_request("history", [*turn1, *turn2, 5])
    assert engine.match(history) == 4 * C
    engine.close()


def test_a_lora_request_neither_loads_nor_stores(
    fleet: dict[str, str], model: ToyRopeModel
) -> None:
    """vLLM keys its own prefix cache by the LoRA adapter too; the node's engine API has no
    field for it, so an adapter's KV and the base model's would share keys. A request under
    an adapter is left out (as prompt embeddings are): it loads nothing the base model (or
    another adapter) stored, and stores nothing a base-model request would load. The old code
    loaded the base model's KV into it (matched 2C) and stored the adapter's for the base."""
    from vllm.lora.request import LoRARequest

    from tests.connector.harness import Engine, make_request

    engine = Engine.start(fleet["a"], model)
    base, tuned = tokens(80, 2 * C), tokens(81, 2 * C)
    adapter = LoRARequest("tenant-adapter", 1, "/adapters/tenant")
    engine.run(make_request("base", [*base, *tokens(82, 3)]))
    assert engine.match(make_request("base-again", [*base, *tokens(83, 3)])) == 2 * C  # control
    assert engine.match(make_request("lora-1", [*base, *tokens(83, 3)], lora=adapter)) == 0
    saved = engine.worker.worker.stats()["chunks_saved"]
    engine.run(make_request("lora-2", [*tuned, *tokens(84, 3)], lora=adapter))
    assert engine.worker.worker.stats()["chunks_saved"] == saved
    assert engine.match(make_request("base-2", [*tuned, *tokens(85, 3)])) == 0
    engine.close()
