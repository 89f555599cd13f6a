"""The process fleet of one live stack: real processes on loopback, cold, torn down after.

A coordinator, N ``kvatlas engine-sim`` (``e0``…), for connector stacks one ``kvatlas node``
per engine (``n0``… beside ``e0``…; their L2 one shared fs pool), and ``kvatlas router`` in
front. Every process logs to its own file in the run's directory; a fleet that does not come
up, or a process that dies, is an :class:`Unavailable` naming it, and :meth:`LiveFleet.tails`
gives the end of every log. Whatever happens (an error, Ctrl-C, or SIGTERM under
:func:`kvatlas.processes.sigterm_as_interrupt`), :meth:`LiveFleet.stop`
ends every process it started, and only those.

Wiring (docs/kv-events.md): each engine's KV-event PUB connects to an endpoint the coordinator
binds on loopback for it (``--kv-events-bind e0=…``), its replay ROUTER binds on loopback and
the coordinator asks it for what it missed (``--kv-events-replay``); a connector engine's
``--node-url`` is its own node's engine API.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final

import httpx

from kvatlas.asgi_thread import free_port
from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.stacks import Stack
from kvatlas.errors import Unavailable

MODEL: Final = "fleet-sim"
"""The served model's name: the engines', the topics', the nodes' and the router's."""
NODE_LAYOUT: Final = ("--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "2",
                      "--dtype", "float16")  # fmt: skip
"""A tiny KV layout: what travels is the node's layout, what it costs the engine's model
(docs/engine-sim.md, "The kvatlas connector")."""
NODE_CHUNK_KV_BYTES: Final = 2 * 1 * 1 * 2 * 2
"""KV bytes per token of :data:`NODE_LAYOUT` (K and V × layers × heads × dims × fp16), what
the node's L1 budget counts."""
START_TIMEOUT_S: Final = 180.0
"""Every process up and the router seeing every engine: a cold Python start per process, up
to 2N + 2 of them sharing the machine."""
DEFAULT_MAX_MODEL_LEN: Final = 131_072
SCORE_TIMEOUT_S: Final = 2.0
"""The router's wait for a score, in wall seconds (its default, 0.05, is for real time)."""
WARM_UP_PROMPT: Final = list(range(1, 9))
"""Shorter than a block: it caches nothing, publishes nothing and stores nothing."""


def memory_dir(prefix: str) -> Path:
    """A directory in memory (``/dev/shm``) when the machine has one, else in the temp dir:
    the shared L2's speed is modelled (``--l2-bandwidth-bytes-per-s``), its files need only hold the
    bytes, and a disk's fsync per chunk on a busy machine would delay stores by wall time that
    counts × speed."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def node_serves_engine(engine_id: str) -> list[str]:
    """The one place a node is told which engine it serves, so that ``/route/score`` counts
    its copies as the engine's own (``kvatlas node --engine-id``; docs/route-scoring.md)."""
    return ["--engine-id", engine_id]


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    url: str
    args: tuple[str, ...]
    """``kvatlas <args>``."""


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """Every process of one stack, with its flags and ports (pure: nothing started)."""

    coordinator: Service
    engines: tuple[Service, ...]
    nodes: tuple[Service, ...]
    router: Service
    l2_path: Path | None

    @property
    def services(self) -> tuple[Service, ...]:
        return (self.coordinator, *self.engines, *self.nodes, self.router)

    @property
    def engine_ids(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.engines)


def plan_fleet(config: FleetConfig, stack: Stack, workdir: Path, max_model_len: int,
               l2_path: Path | None = None) -> FleetPlan:  # fmt: skip
    """The processes of ``stack``: ``max_model_len`` covers the longest request replayed;
    ``l2_path`` is the shared pool's directory (default ``workdir/l2``)."""
    n = config.engines
    ids = [f"e{i}" for i in range(n)]
    coord_port, router_port = free_port(), free_port()
    coord_url = f"http://127.0.0.1:{coord_port}"
    pubs = [free_port() for _ in ids]
    replays = [free_port() for _ in ids]
    coordinator = Service("coordinator", coord_url, (
        "coordinator", "--port", str(coord_port), "--chunk-size", str(config.chunk_size),
        "--enable-blend-lookup", "--instance-timeout", "3600",
        "--kv-events-bind", ",".join(f"{e}=tcp://127.0.0.1:{p}" for e, p in zip(ids, pubs, strict=True)),
        "--kv-events-replay", ",".join(f"tcp://127.0.0.1:{p}" for p in replays),
        # every block every engine holds, on GPU and in its CPU offload
        "--kv-events-max-blocks", str(max(500_000, n * (config.gpu_blocks + config.host_blocks))),
        "--log-level", "warning", "--log-format", "text",
    ))  # fmt: skip
    nodes: list[Service] = []
    l2_path = (l2_path or workdir / "l2") if stack.connector else None
    if stack.connector:
        l1_chunks = config.host_blocks * config.block_size // config.chunk_size
        for i, engine in enumerate(ids):
            port = free_port()
            nodes.append(Service(f"n{i}", f"http://127.0.0.1:{port}", (
                "node", "--port", str(port), "--instance-id", f"n{i}", "--model-name", MODEL,
                *NODE_LAYOUT, "--chunk-size", str(config.chunk_size),
                "--l1-bytes", str(l1_chunks * config.chunk_size * NODE_CHUNK_KV_BYTES),
                "--l2", "fs", "--l2-shared", "--l2-path", str(l2_path),
                "--coordinator-url", coord_url, "--coordinator-event-reporting",
                "--max-query-tokens", str(max_model_len),
                *node_serves_engine(engine),
                "--log-level", "warning", "--log-format", "text",
            )))  # fmt: skip
    engines = []
    for i, engine in enumerate(ids):
        port = free_port()
        connector = ("--node-url", nodes[i].url) if stack.connector else ()
        engines.append(Service(engine, f"http://127.0.0.1:{port}", (
            "engine-sim", "--port", str(port), "--model", MODEL, "--instance-id", engine,
            "--speed", repr(config.speed), "--block-size", str(config.block_size),
            "--gpu-blocks", str(config.gpu_blocks),
            # the same host memory per engine: vLLM's CPU offload, or the node's L1
            "--cpu-blocks", "0" if stack.connector else str(config.host_blocks),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens),
            "--max-num-seqs", str(config.max_num_seqs), "--max-model-len", str(max_model_len),
            "--recompute-share", repr(config.recompute_share),
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pubs[i]}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replays[i]}",
            *connector, "--log-level", "warning", "--log-format", "text",
        )))  # fmt: skip
    router = Service("router", f"http://127.0.0.1:{router_port}", (
        "router", "--port", str(router_port), "--coordinator-url", coord_url,
        "--engine", ",".join(f"{e.name}={e.url}" for e in engines), "--policy", stack.policy,
        "--model-name", MODEL, "--seed", str(config.seed),
        # a score the coordinator is slow to give on a busy machine is a live artefact, not a
        # decision by load: wait for it (its wall time still counts in the TTFT, × speed)
        "--score-timeout-s", repr(SCORE_TIMEOUT_S),
        # vLLM's gauges every config.metrics_interval_s model seconds (by default the
        # router's: as at speed 1), as the virtual mode scrapes
        "--metrics-interval-s", repr(config.metrics_interval_s / config.speed),
        "--log-level", "warning", "--log-format", "text",
    ))  # fmt: skip
    return FleetPlan(coordinator, tuple(engines), tuple(nodes), router, l2_path)


class LiveFleet:
    """Starts a :class:`FleetPlan`'s processes and ends them (a context manager)."""

    def __init__(self, plan: FleetPlan, workdir: Path, progress: Callable[[str], None]) -> None:
        self.plan = plan
        self.workdir = workdir
        self.progress = progress
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def __enter__(self) -> LiveFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        """Every process at once (any start order works), then wait until each answers and
        the router sees every engine healthy, and every node is registered."""
        if self.plan.l2_path is not None:
            self.plan.l2_path.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        for service in self.plan.services:
            with open(self.log_path(service.name), "ab") as log:
                self.procs[service.name] = subprocess.Popen(
                    [sys.executable, "-m", "kvatlas.cli", *service.args],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=dict(os.environ),
                )  # fmt: skip
        deadline = started + START_TIMEOUT_S
        with httpx.Client(timeout=2.0) as http:
            for service in self.plan.services:
                answers = partial(_answers, http, f"{service.url}/healthz")
                self._wait(service.name, answers, deadline, "did not answer /healthz")
            router = self.plan.router.url
            self._wait("router", lambda: _router_sees_all(http, router, self.plan.engine_ids),
                       deadline, "does not see every engine healthy")  # fmt: skip
            nodes = {n.name for n in self.plan.nodes}
            coordinator = self.plan.coordinator.url
            self._wait("coordinator", lambda: nodes <= _registered(http, coordinator),
                       deadline, f"has not registered every node ({sorted(nodes)})")  # fmt: skip
            self.warm_up(http)
        self.progress(f"{len(self.procs)} processes up in {time.monotonic() - started:.1f} s")

    def warm_up(self, http: httpx.Client) -> None:
        """One request shorter than a block to each engine directly (not through the router:
        its round-robin and random policies would move on), so that first-call costs (the
        connector's first contact with its node, connections) are not in the replay's first
        TTFTs; the cache stays cold."""
        for engine in self.plan.engines:
            body = {"model": MODEL, "prompt": WARM_UP_PROMPT, "max_tokens": 1}
            reply = http.post(f"{engine.url}/v1/completions", json=body, timeout=60.0)
            if reply.status_code != 200:
                raise Unavailable(f"live fleet: {engine.name} refused its warm-up request: "
                                  f"HTTP {reply.status_code} {reply.text[:200]}")  # fmt: skip

    def _wait(self, name: str, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                codes = ", ".join(f"{n} (exit {self.procs[n].returncode})" for n in dead)
                raise Unavailable(f"live fleet: {codes} stopped while starting")
            if time.monotonic() > deadline:
                raise Unavailable(f"live fleet: {name} {what} after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)

    def check_running(self) -> None:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead:
            codes = ", ".join(f"{n} (exit {self.procs[n].returncode})" for n in dead)
            raise Unavailable(f"live fleet: {codes} stopped during the replay")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every process started here (the router first: no new work), wait, then
        SIGKILL what is left. Safe to call twice."""
        order = ["router", *(s.name for s in self.plan.engines),
                 *(s.name for s in self.plan.nodes), "coordinator"]  # fmt: skip
        procs = [self.procs[n] for n in order if n in self.procs]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def tails(self, lines: int = 15) -> str:
        """The last ``lines`` lines of every process's log."""
        out = []
        for service in self.plan.services:
            path = self.log_path(service.name)
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            out.append(f"--- {path} (last {min(lines, len(text))} lines)")
            out.extend(text[-lines:])
        return "\n".join(out)


def _answers(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _router_sees_all(http: httpx.Client, router: str, engines: tuple[str, ...]) -> bool:
    try:
        state = http.get(f"{router}/healthz").json().get("engines", {})
    except (httpx.HTTPError, ValueError):
        return False
    return all(state.get(e, {}).get("healthy") for e in engines)


def _registered(http: httpx.Client, coordinator: str) -> set[str]:
    try:
        reply = http.get(f"{coordinator}/instances").json()
    except (httpx.HTTPError, ValueError):
        return set()
    items = reply.get("instances", []) if isinstance(reply, dict) else reply
    return {i.get("instance_id", "") for i in items if isinstance(i, dict)}
