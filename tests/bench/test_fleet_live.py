"""``kvatlas bench fleet --mode live`` (issue 27 item 4): real processes on loopback.

A handful of requests through two stacks (round-robin without the connector, kvatlas with it):
every request answered once, times in order, cached tokens within the prompt, the router really
in the path (round-robin alternates), the connector really reusing (fragments) where it is on
and nowhere else. A fleet that cannot start is torn down whole, its logs' tails shown. The
pure parts (the flags of each process, the engines' counters → records) are checked apart.
No assertion on a duration.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.live import EngineCounts, Reply, run_stack, to_records
from kvatlas.bench.fleet.live_fleet import NODE_CHUNK_KV_BYTES, LiveFleet, plan_fleet
from kvatlas.bench.fleet.results import summarize
from kvatlas.bench.fleet.stacks import STACKS
from kvatlas.errors import Conflict, Unavailable
from kvatlas.workloads import TraceRequest, open_workload

# 3 documents, 2 per request at varying offsets: fragments to reuse from the second request on;
# arrivals 0.5 s apart (model = wall at speed 1): each request's chunks are stored before the next
WORKLOAD = "rag:docs=3,k=2,zipf=0.5,rate=2,seed=1,doc_min=512,doc_max=1024,output=4"
REQUESTS = 6


def config(**changes: object) -> FleetConfig:
    base = FleetConfig(trace=WORKLOAD, stacks=(STACKS["round-robin"], STACKS["kvatlas"]),
                       engines=2, requests=REQUESTS, speed=1.0, gpu_blocks=4096,
                       host_blocks=4096)  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


def test_plan_gives_each_stack_its_processes(tmp_path: Path) -> None:
    cfg = config()
    plain = plan_fleet(cfg, STACKS["prefix"], tmp_path, 131_072)
    assert plain.nodes == () and plain.l2_path is None
    assert [e.name for e in plain.engines] == ["e0", "e1"]
    for engine in plain.engines:
        assert flag(engine.args, "--cpu-blocks") == "4096"  # vLLM's CPU offload
        assert "--node-url" not in engine.args
    assert flag(plain.router.args, "--policy") == "prefix"
    assert flag(plain.router.args, "--engine") == ",".join(
        f"{e.name}={e.url}" for e in plain.engines
    )

    wired = plan_fleet(cfg, STACKS["kvatlas"], tmp_path, 131_072)
    assert [n.name for n in wired.nodes] == ["n0", "n1"]
    l1_chunks = cfg.host_blocks * cfg.block_size // cfg.chunk_size
    for engine, node in zip(wired.engines, wired.nodes, strict=True):
        assert flag(engine.args, "--cpu-blocks") == "0"  # the host memory is the node's L1
        assert flag(engine.args, "--node-url") == node.url
        # the engine uses only a node of its model (it stores zeros: docs/engine-sim.md)
        assert flag(node.args, "--model-name") == flag(engine.args, "--model")
        assert flag(node.args, "--l1-bytes") == str(
            l1_chunks * cfg.chunk_size * NODE_CHUNK_KV_BYTES
        )
        assert flag(node.args, "--l2-path") == str(wired.l2_path) and "--l2-shared" in node.args
        assert flag(node.args, "--chunk-size") == str(cfg.chunk_size)
    events = flag(wired.coordinator.args, "--kv-events-bind").split(",")
    assert [e.split("=")[0] for e in events] == ["e0", "e1"]
    for engine, endpoint in zip(wired.engines, events, strict=True):
        assert flag(engine.args, "--kv-events-endpoint") == endpoint.split("=", 1)[1]


def reply(index: int, engine: str, prompt: int, cached: int) -> Reply:
    return Reply(index, engine, 0.1 * index, 0.1 * index + 0.05, 0.1 * index + 0.2, prompt,
                 cached, 4)  # fmt: skip


def request(index: int, prompt: int) -> TraceRequest:
    import numpy as np

    return TraceRequest(index, 0.1 * index, np.zeros(prompt, dtype=np.int64), 4)


def test_fragments_come_from_the_engines_counters_and_their_sums_are_exact() -> None:
    cfg = config(recompute_share=0.15)
    requests = [request(0, 1000), request(1, 1000), request(2, 900)]
    replies = [reply(0, "e0", 1000, 0), reply(1, "e0", 1000, 256), reply(2, "e1", 900, 512)]
    counts = {
        "e0": EngineCounts(2000, 2000 - 256, 701, 0.0),
        "e1": EngineCounts(900, 900 - 512, 0, 0.0),
    }
    records = to_records(cfg, requests, replies, counts)
    assert [r.index for r in records] == [0, 1, 2]
    assert sum(r.fragment_tokens for r in records) == round(701 * 0.85)  # e0's, less the share
    assert records[2].fragment_tokens == 0 and records[2].reused_tokens == 512
    assert all(r.reused_tokens <= r.prompt_tokens for r in records)
    assert summarize(records).prefill_tokens == 2900 - 256 - 512 - round(701 * 0.85)
    assert records[1].ttft_s == pytest.approx(0.05 * cfg.speed)

    wrong = {**counts, "e1": EngineCounts(900, 900, 0, 0.0)}  # e1 says it reused nothing
    with pytest.raises(Conflict, match="engine e1"):
        to_records(cfg, requests, replies, wrong)
    with pytest.raises(Conflict, match="not an engine"):
        to_records(cfg, requests, [*replies[:2], reply(2, "e9", 900, 512)], counts)


def test_live_replay_through_two_stacks() -> None:
    cfg = config()
    requests = list(open_workload(WORKLOAD, REQUESTS))
    lines: list[str] = []
    by_stack = {s.name: run_stack(cfg, s, requests, lines.append) for s in cfg.stacks}
    assert any("processes up" in line for line in lines)  # progress was reported
    for name, records in by_stack.items():
        assert [r.index for r in records] == [r.index for r in requests], name
        for r, req in zip(records, requests, strict=True):
            assert r.prompt_tokens == req.input_tokens
            assert r.output_tokens == req.output_tokens
            assert r.arrival_s < r.first_token_s <= r.finished_s and r.ttft_s > 0
            assert 0 <= r.fragment_tokens <= r.reused_tokens <= r.prompt_tokens
            assert r.engine in {"e0", "e1"}
    # the router is in the path with the stack's policy: round-robin alternates
    order = sorted(by_stack["round-robin"], key=lambda r: r.arrival_s)
    assert [r.engine for r in order] == ["e0", "e1"] * (REQUESTS // 2)
    # the connector reuses documents at other offsets where it is on, and only there
    assert sum(r.fragment_tokens for r in by_stack["kvatlas"]) > 0
    assert sum(r.fragment_tokens for r in by_stack["round-robin"]) == 0
    assert summarize(by_stack["kvatlas"]).hit_ratio > summarize(by_stack["round-robin"]).hit_ratio


def test_a_fleet_that_cannot_start_is_stopped_whole_with_its_logs(tmp_path: Path) -> None:
    cfg = config(gpu_blocks=1, engines=1)  # engine-sim refuses: block 0 is vLLM's null block
    plan = plan_fleet(cfg, STACKS["prefix"], tmp_path, 131_072)
    fleet = LiveFleet(plan, tmp_path, lambda _: None)
    with pytest.raises(Unavailable, match="stopped while starting"):
        fleet.__enter__()
    assert len(fleet.procs) == len(plan.services)
    assert all(p.poll() is not None for p in fleet.procs.values())  # nothing left running
    tails = fleet.tails()
    assert "e0.log" in tails and "--gpu-blocks must be at least 2" in tails


RUNNER = """
import sys
from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.live import run_stack
from kvatlas.bench.fleet.stacks import STACKS
from kvatlas.workloads import open_workload

workload = "rag:docs=3,k=2,rate=0.01,seed=1,output=4"  # arrivals ~100 s apart: still replaying
config = FleetConfig(trace=workload, stacks=(STACKS["prefix"],), engines=1, speed=1.0,
                     gpu_blocks=1024, host_blocks=1024)
run_stack(config, STACKS["prefix"], list(open_workload(workload, 3)),
          lambda line: print(line, flush=True))
"""


def test_an_interrupted_replay_stops_every_process_it_started() -> None:
    """SIGTERM (a service manager's stop) to the bench alone; Ctrl-C (SIGINT) unwinds through
    the same ``except KeyboardInterrupt`` path."""
    bench = subprocess.Popen([sys.executable, "-c", RUNNER], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=dict(os.environ))  # fmt: skip
    assert bench.stdout is not None
    out: list[str] = []
    children: list[str] = []
    try:
        for raw in bench.stdout:
            out.append(raw.decode())
            if "processes up" in out[-1]:
                break
        children = Path(f"/proc/{bench.pid}/task/{bench.pid}/children").read_text().split()
        assert len(children) == 3, out  # coordinator, e0, router
        bench.send_signal(signal.SIGTERM)
        rest = bench.communicate(timeout=120)[0].decode()
        left = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in children:  # whatever the bench left behind, so a failure leaks nothing
            if Path(f"/proc/{pid}").exists():
                os.kill(int(pid), signal.SIGKILL)
    assert bench.returncode != 0
    assert "interrupted; every process stopped" in rest, rest[-2000:]
    assert left == []
