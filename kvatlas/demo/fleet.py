"""The fleet demo: a coordinator and two cache nodes play a RAG workload.

Documents are first cached at random positions on either node; then queries assembled from
shuffled documents plus new text arrive at either node. Each query takes its prefix from the
cache, finds the rest of its documents anywhere in the fleet (blend lookup), fetches them from
local L1, the other node's L1 or L2, and re-RoPEs them to their new positions. Every reused
chunk is checked against the toy model's KV computed fresh at its new position.

Embedded (default): everything in this process. ``--processes``: a coordinator and two node
processes over HTTP on loopback, same workload.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvatlas.asgi_thread import free_port
from kvatlas.demo import serve
from kvatlas.node import (
    EmbeddedFleet,
    KVLayout,
    NodeConfig,
    NodeEngineClient,
    Segment,
    ToyRopeModel,
)
from kvatlas.processes import spawn_service, stop

C = 64
LAYOUT_FLAGS: dict[str, Any] = dict(
    model_name="demo-model",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    chunk_size=C,
    dtype="float32",
)
VOCAB = 500


class DemoNode(Protocol):
    """What the demo needs from a node, embedded or over HTTP."""

    name: str

    def store(self, tokens: Any, kv: list[Any], request_id: str) -> int: ...

    def retrieve(self, tokens: Any, request_id: str) -> tuple[list[Any], dict[str, int]]: ...

    def blend_lookup(
        self, tokens: Any, request_id: str, prefix_len: int
    ) -> list[Segment] | None: ...

    def blend_retrieve(
        self, tokens: Any, request_id: str, segments: list[Segment]
    ) -> tuple[list[tuple[Segment, Any]], int, dict[str, int]]: ...


class EmbeddedNode:
    def __init__(self, name: str, fleet: EmbeddedFleet) -> None:
        self.name = name
        self.node = fleet.nodes[name]
        self._trackers: dict[str, Any] = {}

    def _tracker(self, tokens: Any, request_id: str) -> Any:
        if request_id not in self._trackers:
            self._trackers[request_id] = self.node.tracker(token_ids=tokens, request_id=request_id)
        return self._trackers[request_id]

    def store(self, tokens: Any, kv: list[Any], request_id: str) -> int:
        return self.node.store(self._tracker(tokens, request_id), kv)

    def retrieve(self, tokens: Any, request_id: str) -> tuple[list[Any], dict[str, int]]:
        got = self.node.retrieve(self._tracker(tokens, request_id))
        return got.kv, dict(got.sources)

    def blend_lookup(self, tokens: Any, request_id: str, prefix_len: int) -> list[Segment] | None:
        result = self.node.blend_lookup(
            self._tracker(tokens, request_id), prefix_len=prefix_len, request_id=request_id
        )
        return None if result is None else list(result.segments)

    def blend_retrieve(
        self, tokens: Any, request_id: str, segments: list[Segment]
    ) -> tuple[list[tuple[Segment, Any]], int, dict[str, int]]:
        got = self.node.blend_retrieve(self._tracker(tokens, request_id), segments)
        return got.parts, len(got.misses), dict(got.sources)


class HttpNode:
    def __init__(self, name: str, client: NodeEngineClient) -> None:
        self.name = name
        self.client = client

    def store(self, tokens: Any, kv: list[Any], request_id: str) -> int:
        return self.client.store(tokens, kv, request_id=request_id)

    def retrieve(self, tokens: Any, request_id: str) -> tuple[list[Any], dict[str, int]]:
        return self.client.retrieve(tokens, request_id=request_id)

    def blend_lookup(self, tokens: Any, request_id: str, prefix_len: int) -> list[Segment] | None:
        return self.client.blend_lookup(tokens, request_id, prefix_len=prefix_len)

    def blend_retrieve(
        self, tokens: Any, request_id: str, segments: list[Segment]
    ) -> tuple[list[tuple[Segment, Any]], int, dict[str, int]]:
        got = self.client.blend_retrieve(tokens, request_id, segments)
        return got["parts"], len(got["misses"]), got["sources"]


@dataclass
class Tally:
    total_tokens: int = 0
    prefix_tokens: int = 0
    blend_tokens: int = 0
    misses: int = 0
    sources: Counter[str] = field(default_factory=Counter)
    lookup_s: list[float] = field(default_factory=list)
    retrieve_s: list[float] = field(default_factory=list)
    max_error: float = 0.0


def _random_tokens(rng: np.random.Generator, n: int) -> np.ndarray[Any, Any]:
    return rng.integers(0, VOCAB, n).astype(np.uint32)


def play(
    nodes: list[DemoNode], layout: KVLayout, *, seed: int, documents: int, queries: int, settle: Any
) -> Tally:
    rng = np.random.default_rng(seed)
    model = ToyRopeModel(layout)
    docs = [_random_tokens(rng, int(rng.integers(2 * C, 5 * C))) for _ in range(documents)]
    system = _random_tokens(
        rng, 2 * C
    )  # a shared system prompt: the prefix every query starts with
    tally = Tally()
    with Progress() as progress:
        warm = progress.add_task("caching documents", total=documents)
        for i, doc in enumerate(docs):
            seq = np.concatenate([system, _random_tokens(rng, int(rng.integers(0, C))), doc])
            node = nodes[int(rng.integers(len(nodes)))]
            node.store(seq, model.kv_chunks(seq), request_id=f"doc-{i}")
            progress.advance(warm)
        settle()
        task = progress.add_task("serving RAG queries", total=queries)
        for q in range(queries):
            picked = rng.permutation(len(docs))[: int(rng.integers(2, 5))]
            parts = [system]
            for d in picked:
                parts += [_random_tokens(rng, int(rng.integers(1, 12))), docs[d]]
            parts.append(_random_tokens(rng, int(rng.integers(C // 2, 2 * C))))  # the question
            query = np.concatenate(parts)
            node = nodes[int(rng.integers(len(nodes)))]
            rid = f"q-{q}"
            started = time.perf_counter()
            prefix_kv, prefix_sources = node.retrieve(query, rid + "-prefix")
            prefix_len = len(prefix_kv) * C
            segments = node.blend_lookup(query, rid, prefix_len)
            while segments is None:  # the fleet leg is pending: an engine would ask again later
                time.sleep(0.001)
                segments = node.blend_lookup(query, rid, prefix_len)
            looked_up = time.perf_counter()
            reused, misses, sources = node.blend_retrieve(query, rid, segments)
            done = time.perf_counter()
            tally.lookup_s.append(looked_up - started)
            tally.retrieve_s.append(done - looked_up)
            for i, kv in enumerate(prefix_kv):
                fresh = model.kv_chunk(query[i * C : (i + 1) * C], i * C)
                tally.max_error = max(tally.max_error, float(np.abs(kv - fresh).max()))
            for seg, kv in reused:
                fresh = model.kv_chunk(
                    query[seg.chunk_cur_st : seg.chunk_cur_st + C], seg.chunk_cur_st
                )
                tally.max_error = max(
                    tally.max_error, float(np.abs(kv - fresh[:, :, seg.kv_slice]).max())
                )
            tally.total_tokens += len(query)
            tally.prefix_tokens += prefix_len
            tally.blend_tokens += sum(seg.length for seg, _ in reused)
            tally.misses += misses
            tally.sources.update({f"prefix {k}": v for k, v in prefix_sources.items()})
            tally.sources.update({f"blend {k}": v for k, v in sources.items()})
            node.store(query, model.kv_chunks(query), request_id=rid + "-store")  # after prefill
            progress.advance(task)
            settle()
    return tally


def report(tally: Tally, mode: str, console: Console) -> None:
    table = Table(title="where reused chunks came from", min_width=60)
    table.add_column("path")
    table.add_column("tier")
    table.add_column("chunks", justify="right")
    for name, count in sorted(tally.sources.items()):
        path, tier = name.split(" ", 1)
        table.add_row(path, tier.replace("_", " "), str(count))
    console.print(table)
    reused = tally.prefix_tokens + tally.blend_tokens
    console.print(
        f"reuse ratio: [bold]{reused / tally.total_tokens:.1%}[/bold] of {tally.total_tokens} query tokens served "
        f"from cache (prefix {tally.prefix_tokens}, fragments {tally.blend_tokens}); segment misses: {tally.misses}"
    )
    console.print(
        f"lookup (prefix retrieve + blend lookup) median {statistics.median(tally.lookup_s) * 1e3:.2f} ms, "
        f"blend retrieval + re-RoPE median {statistics.median(tally.retrieve_s) * 1e3:.2f} ms per query"
    )
    console.print(
        f"every reused chunk checked against fresh KV at its new position: max |error| = {tally.max_error:.2e}"
    )


Done = Callable[[Tally, "str | None"], None]
"""Called with the tally while the fleet is still up, and the coordinator's URL when it has
one (``--serve``: :func:`kvatlas.demo.serve.hold` waits there for Ctrl-C)."""


def run_embedded(
    seed: int, documents: int, queries: int, console: Console, done: Done | None = None
) -> Tally:
    """``done`` given: the fleet runs around a coordinator service (its status page)."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        chunk_bytes = NodeConfig(**LAYOUT_FLAGS).layout.chunk_bytes
        configs = [
            NodeConfig(
                **LAYOUT_FLAGS, l1_bytes=48 * chunk_bytes, l2="fs", l2_shared=True, l2_write="evict"
            )
            for _ in range(2)
        ]
        server = None if done is None else stack.enter_context(serve.coordinator(C))
        if server is None:
            fleet = stack.enter_context(EmbeddedFleet(configs, l2_root=Path(tmp)))
        else:
            service = server.service
            served = EmbeddedFleet(
                configs,
                l2_root=Path(tmp),
                directory=service.directory,
                consume=lambda batch: service.ingest([batch]),
            )
            fleet = stack.enter_context(served)
            stack.enter_context(serve.registered(fleet, server))
        nodes: list[DemoNode] = [EmbeddedNode(name, fleet) for name in fleet.nodes]
        tally = play(
            nodes,
            configs[0].layout,
            seed=seed,
            documents=documents,
            queries=queries,
            settle=fleet.settle,
        )
        if done is not None:
            done(tally, None if server is None else server.url)
        return tally


@contextmanager
def _processes(tmp: Path) -> Iterator[tuple[str, list[str]]]:
    coord_port = free_port()
    coordinator = f"http://127.0.0.1:{coord_port}"
    chunk_bytes = NodeConfig(**LAYOUT_FLAGS).layout.chunk_bytes
    commands = [
        [
            "coordinator",
            "--port",
            str(coord_port),
            "--chunk-size",
            str(C),
            "--enable-blend-lookup",
            "--log-level",
            "warning",
        ]
    ]
    urls = []
    for name in ("node-a", "node-b"):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in LAYOUT_FLAGS.items()]
        commands.append(
            ["node", "--port", str(port), "--instance-id", name, "--coordinator-url", coordinator,
             "--coordinator-event-reporting", "--l2", "fs", "--l2-shared", "--l2-path", str(tmp), "--l2-write", "evict",
             "--l1-bytes", str(48 * chunk_bytes), "--log-level", "warning", *flags]
        )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for command, url in zip(commands, [coordinator, *urls], strict=True):
            procs.append(spawn_service(["-m", "kvatlas.cli", *command], url, quiet=False))
        yield coordinator, urls
    finally:
        stop(procs)


def run_processes(
    seed: int, documents: int, queries: int, console: Console, done: Done | None = None
) -> Tally:
    layout = NodeConfig(**LAYOUT_FLAGS).layout
    with tempfile.TemporaryDirectory() as tmp, _processes(Path(tmp)) as (coordinator, urls):
        clients = [NodeEngineClient(url, layout) for url in urls]
        nodes: list[DemoNode] = [HttpNode(f"node-{i}", c) for i, c in enumerate(clients)]

        def settle() -> None:
            # Events travel asynchronously (outbox → POST /events): wait until the directory
            # stops changing, like an engine that does not care would simply not wait.
            last = -1
            with httpx.Client() as client:  # one for every poll (processes.is_healthy says why)
                while True:
                    stats = client.get(f"{coordinator}/directory/stats").json()
                    if stats["batches"]["applied"] == last:
                        return
                    last = stats["batches"]["applied"]
                    time.sleep(0.1)

        try:
            tally = play(
                nodes, layout, seed=seed, documents=documents, queries=queries, settle=settle
            )
            if done is not None:
                done(tally, coordinator)
            return tally
        finally:
            for c in clients:
                c.close()


def run_fleet_demo(
    *,
    seed: int = 0,
    processes: bool = False,
    documents: int = 24,
    queries: int = 40,
    serve_page: bool = False,
) -> int:
    """``serve_page``: after the report, print the status page URL and keep the fleet up
    until Ctrl-C."""
    console = Console(width=max(Console().width, 120))
    mode = (
        "coordinator + 2 node processes over HTTP"
        if processes
        else "embedded: coordinator + 2 nodes in one process"
    )
    console.print(f"[bold]kvatlas fleet demo[/bold] — {mode}; chunk size {C}, toy RoPE model")
    started = time.perf_counter()

    def done(tally: Tally, url: str | None) -> None:
        report(tally, mode, console)
        console.print(f"done in {time.perf_counter() - started:.1f} s")
        if url is not None:
            serve.hold(url, console)

    run = run_processes if processes else run_embedded
    tally = run(seed, documents, queries, console, done if serve_page else None)
    if not serve_page:
        done(tally, None)
    ok = tally.max_error < 1e-3 and tally.blend_tokens > 0
    return 0 if ok else 1
