"""The optional kvatlas connector (``--node-url``): the simulated engine reuses KV through a
real kvatlas node, as vLLM with kvatlas's KV connector would (docs/vllm.md).

Before a request runs, the node is asked for the request's prefix (``/engine/retrieve``) and,
after that prefix, for fragments: cached chunks at other offsets (``/engine/blend-lookup`` then
``/engine/blend-retrieve``). After its prefill the request's full chunks are stored there
(``/engine/store``). The KV travelling is the node's own layout — run the node with a tiny
one (e.g. 1 layer, 1 head, 2 dims): only its presence matters — while the time a reused token
costs is priced at the simulated model's size (``--kv-bytes-per-token``) over the bandwidth of
the tier the node says it came from. A fragment also pays its recompute share (CacheBlend
recomputes a share of a reused fragment's tokens to repair cross-attention). A node that fails
or refuses is a miss, counted, never a failed request.

The KV it stores is zeros: only a node of the simulated model (its ``--model-name`` is the
simulator's ``--model``) is used. Another model's node, a real model's, would keep zeros under
that model's keys and serve them to its engines: it is refused (the connector stays off).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from kvatlas.client.engine_client import EngineClient, EngineLayout, WireSegment
from kvatlas.engine_sim.scheduler import SimRequest
from kvatlas.errors import KvatlasError

log = logging.getLogger(__name__)
POLL_LIMIT = 50  # blend-lookup polls before the fragments are given up on (fleet leg pending)


@dataclass(frozen=True, slots=True)
class TierRates:
    """Bytes per second from each node source into the engine's GPU blocks."""

    local_l1_bytes_s: float
    l2_bytes_s: float
    peer_bytes_s: float

    def of(self, source: str) -> float:
        if source == "local_l1":
            return self.local_l1_bytes_s
        if source == "l2":
            return self.l2_bytes_s
        return self.peer_bytes_s  # peer_l1, peer_l2


@dataclass(frozen=True, slots=True)
class NodeReuse:
    """What the node supplies for one request: ``prefix_tokens`` from the start and the
    modelled seconds to load them; fragments as ``(start, length)`` ranges after the prefix and
    the seconds to load those; the chunks per node source."""

    prefix_tokens: int = 0
    prefix_load_s: float = 0.0
    fragments: tuple[tuple[int, int], ...] = ()
    fragment_load_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)

    @property
    def fragment_tokens(self) -> int:
        return sum(n for _, n in self.fragments)

    @classmethod
    def of(cls, prefix_sources: dict[str, int], fragments: Sequence[tuple[int, int]],
           fragment_sources: dict[str, int], chunk_size: int, kv_bytes_per_token: int,
           rates: TierRates) -> NodeReuse:  # fmt: skip
        """What a node answered (chunks per source of the prefix and of the fragments, the
        fragments' spans) priced: each chunk's modelled bytes over its source's bandwidth."""
        bytes_per_chunk = chunk_size * kv_bytes_per_token

        def load_s(sources: dict[str, int]) -> float:
            return sum(n * bytes_per_chunk / rates.of(s) for s, n in sources.items())

        every = Counter(prefix_sources) + Counter(fragment_sources)
        return cls(sum(prefix_sources.values()) * chunk_size, load_s(prefix_sources),
                   tuple(fragments), load_s(fragment_sources), dict(every))  # fmt: skip

    def apply_to(self, sim: SimRequest, recompute_share: float) -> None:
        """Set what the node supplies on the request before it is added to the engine (the
        engine process and the virtual fleet benchmark alike)."""
        sim.node_prefix_tokens, sim.node_prefix_load_s = self.prefix_tokens, self.prefix_load_s
        sim.fragments, sim.fragment_load_s = self.fragments, self.fragment_load_s
        sim.recompute_share = recompute_share


class NodeConnector:
    """``model``: the simulator's ``--model``, which the node's ``model_name`` must be."""

    def __init__(self, url: str, model: str, block_size: int, kv_bytes_per_token: int,
                 rates: TierRates, timeout_s: float = 10.0, token: str | None = None) -> None:  # fmt: skip
        self.url = url
        self.model = model
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.rates = rates
        self.timeout_s = timeout_s
        self._token = token
        self._client: EngineClient | None = None
        self.chunk_size = 0
        self.incompatible = False
        self._zeros: np.ndarray | None = None
        self.counts: Counter[str] = Counter()

    def client(self) -> EngineClient | None:
        """The node's client, made at first contact (any start order: a node that is not up
        yet is a miss, and the next request tries again); ``None`` while unreachable, or for
        good when the node is of another model or its chunk size does not fit the block size
        (logged once, counted as ``node_refused``)."""
        if self._client is not None or self.incompatible:
            return self._client
        try:
            client = EngineClient(self.url, timeout=self.timeout_s, token=self._token)
        except (KvatlasError, httpx.HTTPError) as exc:
            self._failed("layout", exc)
            return None
        layout = client.layout
        assert isinstance(layout, EngineLayout)
        refusal = self._refusal(layout)
        if refusal is not None:
            log.error("node %s: %s; the connector is off", self.url, refusal)
            self.incompatible = True
            self.counts["node_refused"] += 1
            client.close()
            return None
        self.chunk_size = layout.chunk_size
        self._zeros = np.zeros(layout.shape, dtype=layout.numpy_dtype())
        self._client = client
        return client

    def _refusal(self, layout: EngineLayout) -> str | None:
        """Why this node cannot serve the simulator (``None``: it can)."""
        if layout.model_name != self.model:
            return (
                f"it holds KV of model_name {layout.model_name!r} (its --model-name), not of "
                f"--model {self.model!r}: the simulator would store zeros under that model's "
                f"keys; point --node-url at a node started with --model-name {self.model!r}"
            )
        if layout.chunk_size % self.block_size:
            return (
                f"chunk size {layout.chunk_size} is not a multiple of --block-size "
                f"{self.block_size}"
            )
        return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def fetch(self, prompt: list[int], cache_salt: str | None, request_id: str,
              local_tokens: int) -> NodeReuse:  # fmt: skip
        """The node's prefix and, after ``max(prefix, local_tokens)``, its fragments."""
        client = self.client()
        if client is None:
            return NodeReuse()
        salt = cache_salt or ""
        try:
            _, sources = client.retrieve(prompt, cache_salt=salt, request_id=request_id)
        except (KvatlasError, httpx.HTTPError) as exc:
            self._failed("retrieve", exc)
            return NodeReuse()
        prefix = sum(sources.values()) * self.chunk_size
        self.counts["lookups"] += 1
        self.counts["prefix_tokens"] += prefix
        fragments: list[tuple[int, int]] = []
        fragment_sources: dict[str, int] = {}
        start = max(prefix, local_tokens)
        if len(prompt) - start >= self.chunk_size:
            fragments = self._fragments(client, prompt, salt, f"{request_id}:blend", start,
                                        fragment_sources)  # fmt: skip
        self.counts["fragment_tokens"] += sum(n for _, n in fragments)
        reuse = NodeReuse.of(dict(sources), fragments, fragment_sources, self.chunk_size,
                             self.kv_bytes_per_token, self.rates)  # fmt: skip
        for name, n in reuse.sources.items():
            self.counts[f"chunks_{name}"] += n
        return reuse

    def _fragments(self, client: EngineClient, prompt: list[int], salt: str, rid: str,
                   prefix_len: int, sources: dict[str, int]) -> list[tuple[int, int]]:  # fmt: skip
        try:
            segments: list[WireSegment] | None = None
            for _ in range(POLL_LIMIT):
                segments = client.blend_segments(prompt, rid, prefix_len=prefix_len,
                                                      cache_salt=salt)  # fmt: skip
                if segments is not None:
                    break
                time.sleep(0.002)
            if not segments:
                return []
            got = client.blend_parts(prompt, rid, segments, cache_salt=salt)
        except (KvatlasError, httpx.HTTPError) as exc:
            self._failed("blend", exc)
            return []
        for name, n in got["sources"].items():
            sources[name] = sources.get(name, 0) + int(n)
        spans = sorted((seg.cur_st, seg.length) for seg, _ in got["parts"])
        return [(s, n) for s, n in spans if s >= prefix_len]

    def store(self, prompt: list[int], cache_salt: str | None, request_id: str) -> None:
        """Store the request's full chunks (tiny KV: the node's layout, zeros)."""
        client = self.client()
        if client is None or len(prompt) < self.chunk_size:
            return
        n = len(prompt) // self.chunk_size
        try:
            stored = client.store(prompt[: n * self.chunk_size], [self._zeros] * n,
                                  cache_salt=cache_salt or "", request_id=request_id)  # fmt: skip
        except (KvatlasError, httpx.HTTPError) as exc:
            self._failed("store", exc)
            return
        self.counts["stored_chunks"] += stored

    def _failed(self, call: str, exc: Exception) -> None:
        self.counts[f"{call}_failures"] += 1
        if self.counts[f"{call}_failures"] & (self.counts[f"{call}_failures"] - 1) == 0:
            log.warning(
                "node %s failed (%d so far): %s", call, self.counts[f"{call}_failures"], exc
            )
