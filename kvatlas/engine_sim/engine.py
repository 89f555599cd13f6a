"""The engine process's clock: drives :class:`EngineCore` step by step in the event loop.

Model time is wall time since start times ``--speed``. A step is scheduled at the model time it
starts, sleeps its modelled duration (divided by the speed) and only then delivers its tokens
and publishes its KV events, so a client and a router see them when a real engine would show
them. Requests that arrive meanwhile join the next step (continuous batching). At a high
speed the process's own overhead per step counts too (it is wall time): docs/engine-sim.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from kvatlas.engine_sim.kv_cache import BlockPool
from kvatlas.engine_sim.metrics import EngineMetrics
from kvatlas.engine_sim.node_connector import NodeConnector
from kvatlas.engine_sim.publisher import KvEventPublisher
from kvatlas.engine_sim.scheduler import EngineCore, SimRequest, TokenOutput
from kvatlas.events.vllm_wire import KVEvent

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Stream:
    """What a request handler reads: sampled tokens as they come (``None`` ends)."""

    request: SimRequest
    tokens: asyncio.Queue[TokenOutput | None] = field(default_factory=asyncio.Queue)


class EngineDriver:
    def __init__(self, core: EngineCore, speed: float, metrics: EngineMetrics,
                 publisher: KvEventPublisher | None,
                 connector: NodeConnector | None = None) -> None:  # fmt: skip
        self.core = core
        self.connector = connector
        self._stores: set[asyncio.Future[None]] = set()
        self.speed = speed
        self.metrics = metrics
        self.publisher = publisher
        self._t0 = time.monotonic()
        self._streams: dict[str, Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def pool(self) -> BlockPool:
        return self.core.pool

    def now_s(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-steps")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: SimRequest) -> Stream:
        stream = Stream(request)
        self._streams[request.request_id] = stream
        self.core.add(request)
        self._wake.set()
        return stream

    def abort(self, request: SimRequest) -> None:
        """The client went away: free the request's blocks (its cached ones stay cached)."""
        if self._streams.pop(request.request_id, None) is not None and request.finished_s is None:
            self.core.abort(request)

    def reset_prefix_cache(self) -> bool:
        done = self.core.reset_prefix_cache()
        self._publish(self.pool.take_events())
        return done

    def _publish(self, events: list[KVEvent]) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)

    async def _run(self) -> None:
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = self.now_s()
            outcome = self.core.step(start)
            if outcome.duration_s == 0.0:
                self._publish(outcome.events)
                ready = self.core.next_ready_s()
                wait_s = max((ready - start) / self.speed, 0.0) if ready is not None else 0.001
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(wait_s, 0.0005))
                continue
            await asyncio.sleep(outcome.duration_s / self.speed)
            end = start + outcome.duration_s
            self._publish(outcome.events)
            for out in outcome.outputs:
                self._deliver(out, end)

    def _deliver(self, out: TokenOutput, end_s: float) -> None:
        req = out.request
        if req.first_token_s is None:
            req.first_token_s = end_s
            self.metrics.ttft.observe(end_s - req.arrival_s)
            if self.connector is not None:  # its prefill is done: store its chunks
                store = asyncio.ensure_future(asyncio.to_thread(
                    self.connector.store, req.prompt, req.cache_salt, f"{req.request_id}:store"))  # fmt: skip
                self._stores.add(store)
                store.add_done_callback(self._stores.discard)
        if out.finished:
            req.finished_s = end_s
            self.metrics.e2e.observe(end_s - req.arrival_s)
            self.metrics.finished(req.finish_reason or "length")
        stream = self._streams.get(req.request_id)
        if stream is None:
            return
        stream.tokens.put_nowait(out)
        if out.finished:
            stream.tokens.put_nowait(None)
            del self._streams[req.request_id]
