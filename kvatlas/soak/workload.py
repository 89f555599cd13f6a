"""The soak's seeded workload through the real engine client: documents stored at random
positions, prefix re-reads (L1 accesses), RAG queries (prefix retrieve, blend lookup, blend
retrieve, then the query's own store) and L2-filling bursts. Deletes are the nodes' own: L1
and L2 evictions under their small budgets. Every served chunk, prefix or blend, is checked
against the toy model's KV computed fresh at the position it is served for."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvatlas.node import KVLayout, NodeEngineClient, ToyRopeModel

TOLERANCE = 1e-3  # float32 KV re-RoPE'd in fp32: errors are ~1e-6; a wrong chunk is O(1)
VOCAB = 500
BLEND_POLL_S = 2.0  # a blend lookup still pending after this is given up (counted)


@dataclass
class Tally:
    """What the workload did and what it got back."""

    ops: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # calls refused or unreachable
    chunks_checked: Counter[str] = field(default_factory=Counter)  # prefix / blend
    wrong_kv: int = 0
    max_error: float = 0.0
    blend_pending: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ops": dict(self.ops),
            "failed": dict(self.failed),
            "chunks_checked": dict(self.chunks_checked),
            "wrong_kv": self.wrong_kv,
            "max_error": self.max_error,
            "blend_pending": self.blend_pending,
        }


class Workload:
    """Seeded operations on whichever nodes are available (a thread runs :meth:`step` in a
    loop between :meth:`pause` and :meth:`resume`)."""

    def __init__(self, urls: dict[str, str], layout: KVLayout, seed: int) -> None:
        self.layout = layout
        self.c = layout.chunk_size
        self.rng = np.random.default_rng(seed)
        self.model = ToyRopeModel(layout)
        self.clients = {
            name: NodeEngineClient(url, layout, timeout=10) for name, url in urls.items()
        }
        self.system = self._tokens(2 * self.c)
        self.docs = [self._tokens(int(self.rng.integers(2, 5)) * self.c) for _ in range(40)]
        self.stored: list[np.ndarray[Any, Any]] = []  # sequences stored so far (re-read later)
        self.available = set(urls)
        self.tally = Tally()
        self._lock = threading.Lock()  # one operation at a time (pause waits for it)
        self._running = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0

    def _tokens(self, n: int) -> np.ndarray[Any, Any]:
        return self.rng.integers(0, VOCAB, n).astype(np.uint32)

    def _rid(self, kind: str) -> str:
        self._seq += 1
        return f"soak-{kind}-{self._seq}"

    # ------------------------------------------------------------------ checks

    def _check(self, kind: str, kv: Any, tokens: Any, start: int, kv_slice: slice) -> None:
        fresh = self.model.kv_chunk(tokens[start : start + self.c], start)
        error = float(np.abs(np.asarray(kv, np.float64) - fresh[:, :, kv_slice]).max())
        self.tally.chunks_checked[kind] += 1
        self.tally.max_error = max(self.tally.max_error, error)
        if not error < TOLERANCE:  # NaN counts as wrong
            self.tally.wrong_kv += 1

    # ------------------------------------------------------------------ operations

    def store(self, node: str, seq: np.ndarray[Any, Any]) -> None:
        self.clients[node].store(seq, self.model.kv_chunks(seq), request_id=self._rid("store"))
        self.stored.append(seq)

    def store_document(self, node: str) -> None:
        doc = self.docs[int(self.rng.integers(len(self.docs)))]
        pad = self._tokens(int(self.rng.integers(0, self.c)))
        self.store(node, np.concatenate([self.system, pad, doc]))

    def reread(self, node: str) -> None:
        """A prefix retrieval of something stored before (an access where it is held)."""
        if not self.stored:
            return self.store_document(node)
        seq = self.stored[int(self.rng.integers(len(self.stored)))]
        kv, _ = self.clients[node].retrieve(seq, request_id=self._rid("read"))
        for i, chunk in enumerate(kv):
            self._check("prefix", chunk, seq, i * self.c, slice(None))

    def rag_query(self, node: str) -> None:
        client = self.clients[node]
        picked = self.rng.permutation(len(self.docs))[: int(self.rng.integers(2, 5))]
        parts = [self.system]
        for d in picked:
            parts += [self._tokens(int(self.rng.integers(1, 12))), self.docs[d]]
        parts.append(self._tokens(int(self.rng.integers(self.c // 2, 2 * self.c))))
        query = np.concatenate(parts)
        rid = self._rid("rag")
        prefix_kv, _ = client.retrieve(query, request_id=rid + "-prefix")
        for i, chunk in enumerate(prefix_kv):
            self._check("prefix", chunk, query, i * self.c, slice(None))
        deadline = time.monotonic() + BLEND_POLL_S
        segments = client.blend_lookup(query, rid, prefix_len=len(prefix_kv) * self.c)
        while segments is None and time.monotonic() < deadline:
            time.sleep(0.01)
            segments = client.blend_lookup(query, rid, prefix_len=len(prefix_kv) * self.c)
        if segments is None:
            self.tally.blend_pending += 1
        else:
            got = client.blend_retrieve(query, rid, segments)
            for seg, kv in got["parts"]:
                self._check("blend", kv, query, seg.chunk_cur_st, seg.kv_slice)
        self.store(node, query)

    def fill_l2(self, node: str, chunks: int) -> None:
        """Store ``chunks`` chunks of new text on ``node``: its L2 passes its cap."""
        per_call = 4
        for _ in range(-(-chunks // per_call)):
            seq = self._tokens(per_call * self.c)
            self.clients[node].store(seq, self.model.kv_chunks(seq), request_id=self._rid("fill"))
        self.tally.ops["l2_fill_chunks"] += chunks

    def step(self) -> None:
        names = sorted(self.available)
        if not names:
            time.sleep(0.05)
            return
        node = names[int(self.rng.integers(len(names)))]
        roll = self.rng.random()
        kind, op = (
            ("store", self.store_document) if roll < 0.35
            else ("reread", self.reread) if roll < 0.55
            else ("rag", self.rag_query)
        )  # fmt: skip
        self.tally.ops[kind] += 1
        try:
            op(node)
        except Exception:  # a node killed or paused mid-call, a refused call: not wrong KV
            self.tally.failed[kind] += 1

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        self._running.set()
        self._thread = threading.Thread(target=self._loop, name="soak-workload", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._running.wait(0.1):
                continue
            with self._lock:
                if self._running.is_set():
                    self.step()

    def pause(self) -> None:
        """Stop issuing operations; returns once the one in flight is done."""
        self._running.clear()
        with self._lock:
            pass

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        self._stop.set()
        self._running.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for client in self.clients.values():
            client.close()
