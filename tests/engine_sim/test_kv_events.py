"""``kvatlas engine-sim``'s KV events, against real processes: everything it publishes (live on
its PUB socket and through vLLM's replay protocol) decodes with vLLM 0.33.0's own decoder, is
the bytes vLLM's own encoder writes for it, and names vLLM's block hashes; LRU eviction becomes
``BlockRemoved``, the CPU tier medium ``CPU``, a reset ``AllBlocksCleared``; and a real kvatlas
coordinator subscribed to it finds the engine holding a prompt's chunks."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvatlas.asgi_thread import free_port
from kvatlas.engine_sim.block_hash import block_hashes
from kvatlas.events.vllm_wire import unpack_seq
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.engine_sim.harness import INSTANCE, MODEL, TOPIC, EngineProcess
from tests.vllm_support import require_vllm

BS = 16


@pytest.fixture(scope="module")
def kv_events() -> ModuleType:
    return require_vllm("vllm.distributed.kv_events")


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_256) for _ in range(n)]


class Subscriber:
    """A plain SUB socket on the engine's PUB endpoint (ZMQ drops what a PUB sends before a
    subscription takes hold: :meth:`joined` sends requests until one batch came through)."""

    def __init__(self, engine: EngineProcess) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{engine.pub_port}")
        self.frames: list[tuple[bytes, int, bytes]] = []

    def joined(self, engine: EngineProcess) -> None:
        for i in range(200):
            engine.complete(ids(10_000 + i, BS + 1), 1)
            if self.poll(0.1):
                return
        raise AssertionError("the PUB socket never reached the subscriber")

    def poll(self, timeout_s: float) -> bool:
        got = False
        while self.sock.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.frames.append((topic, unpack_seq(seq), payload))
            got, timeout_s = True, 0.05
        return got

    def close(self) -> None:
        self.sock.close(0)


def events_of(frames: list[tuple[bytes, int, bytes]], kv_events: ModuleType) -> list[Any]:
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    out = []
    for _, _, payload in frames:
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0  # vLLM stamps its rank
        assert msgspec.msgpack.encode(batch) == payload  # vLLM's own encoder: the same bytes
        out += batch.events
    return out


@pytest.fixture
def small_engine() -> Iterator[EngineProcess]:
    sim = EngineProcess("--gpu-blocks", "9", "--cpu-blocks", "16")  # 8 usable GPU blocks
    yield sim
    sim.close()


def test_what_it_publishes_is_vllms_wire(
    small_engine: EngineProcess, kv_events: ModuleType
) -> None:
    engine = small_engine
    sub = Subscriber(engine)
    try:
        sub.joined(engine)
        assert engine.post("/reset_prefix_cache", b"").status_code == 200  # from a clean cache
        first, second = ids(1, 3 * BS + 1), ids(2, 3 * BS + 1)
        for prompt in (first, second, first):  # "first" again: "second" is least recently used
            engine.complete(prompt, 1)
        engine.complete(ids(3, 5 * BS), 1)  # needs 5 of the 8 blocks: "second" goes
        assert engine.post("/reset_prefix_cache", b"").status_code == 200
        assert wait_for(lambda: engine.healthz()["kv_event_batches"] > 0 and sub.poll(0.2)
                        and isinstance(events_of(sub.frames[-1:], kv_events)[-1],
                                       kv_events.AllBlocksCleared), 30)  # fmt: skip
    finally:
        sub.close()
    replayed = engine.replay(0)
    assert [seq for _, seq, _ in replayed] == list(range(len(replayed)))
    assert {topic for topic, _, _ in replayed} == {TOPIC.encode()}
    live = {seq: (topic, payload) for topic, seq, payload in sub.frames}
    assert live and all(live[s] == (t, p) for t, s, p in replayed if s in live)  # same bytes
    events = events_of(replayed, kv_events)
    clears = [i for i, e in enumerate(events) if isinstance(e, kv_events.AllBlocksCleared)]
    assert len(clears) == 2
    events = events[clears[0] + 1 :]  # the scenario, after the join's requests

    gpu_stored = [e for e in events if isinstance(e, kv_events.BlockStored) and e.medium == "GPU"]
    mine = [e for e in gpu_stored if e.block_hashes == block_hashes(first, BS)]
    assert mine, "the first prompt's blocks were never published"
    stored = mine[0]
    assert stored.parent_block_hash is None and stored.token_ids == first[: 3 * BS]
    assert (stored.block_size, stored.lora_id, stored.lora_name) == (BS, None, None)
    assert stored.extra_keys == [None, None, None] and stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention"
    cpu = {h for e in events if isinstance(e, kv_events.BlockStored) and e.medium == "CPU"
           for h in e.block_hashes}  # fmt: skip
    assert set(block_hashes(first, BS)) <= cpu  # written through to the offload tier
    removed = [h for e in events if isinstance(e, kv_events.BlockRemoved) and e.medium == "GPU"
               for h in e.block_hashes]  # fmt: skip
    assert set(removed) == set(block_hashes(second, BS))  # exactly the LRU blocks, no others
    assert isinstance(events[-1], kv_events.AllBlocksCleared)
    # a replay from the middle returns that suffix, and nothing before it
    assert engine.replay(3) == replayed[3:]


def test_a_coordinator_finds_the_engine_holding_the_prompt(kv_events: ModuleType) -> None:
    engine = EngineProcess("--gpu-blocks", "64", "--cpu-blocks", "64")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    coordinator = None
    try:
        prompt, never = ids(21, 6 * BS + 5), ids(22, 6 * BS + 5)  # 3 chunks of 32 tokens
        engine.complete(prompt, 2)  # published before the coordinator subscribed: replayed
        coordinator = spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", "32",
             "--kv-events-subscribe", f"{INSTANCE}=tcp://127.0.0.1:{engine.pub_port}",
             "--kv-events-replay", f"tcp://127.0.0.1:{engine.replay_port}"],
            url,
        )  # fmt: skip

        def holders(tokens: list[int]) -> dict[tuple[str, str], int]:
            found = HTTP.post(f"{url}/directory/lookup",
                               json={"token_ids": tokens, "model_name": MODEL}).json()  # fmt: skip
            return {(h["instance_id"], h["tier"]): h["chunks"] for h in found["prefix"]}

        def found_all() -> bool:
            engine.complete(ids(23, BS + 1), 1)  # batches after the subscription took hold
            return holders(prompt) == {(INSTANCE, "gpu"): 3, (INSTANCE, "engine-cpu"): 3}

        assert wait_for(found_all, 60), holders(prompt)
        assert holders(never) == {}  # the negative control
        subscriber = httpx.get(f"{url}/healthz").json()["kv_events"]["subscriber"]
        assert not any(v for k, v in subscriber.items() if k.startswith("rejected")), subscriber
    finally:
        if coordinator is not None:
            stop([coordinator])
        engine.close()
