"""The connector in vLLM's worker: loads and saves between the paged cache and the node.

Order within a step (vLLM's ``KVConnectorModelRunnerMixin`` and attention hook):
``start_load_kv`` (fetch every load from the node), then per attention layer
``wait_for_layer_load`` (write that layer's rows) and ``save_kv_layer`` (copy that layer's
rows of every chunk to save), then ``wait_for_save`` (send the saves). A row the node could
not supply is never left looking loaded: its block is reported by
``get_block_ids_with_load_errors`` and vLLM recomputes from there. A layer the model never
asked for is written late and reported the same way (its attention ran without it). A store
whose chunks were computed over such rows in the same step is dropped (counted), never sent.
Before a step's loads, and before its stores, the node's layout is read again: a node
restarted in another layout is used for nothing (its bytes read in ours would be wrong KV).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvatlas.client import EngineLayout
from kvatlas.connector.metadata import KvatlasConnectorMetadata, LoadOp, StoreOp
from kvatlas.connector.node_link import NodeLink
from kvatlas.connector.pages import from_numpy, gather_rows, scatter_rows, to_numpy, token_rows
from kvatlas.connector.settings import backend_packing
from kvatlas.errors import InvalidInput

log = logging.getLogger(__name__)
_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names: list[str], num_layers: int) -> dict[str, int]:
    """Each attention layer's index in the node's chunk, from its name's one integer
    (``model.layers.7.self_attn.attn`` → 7); refused unless they are exactly ``0..L-1``."""
    index = {}
    for name in names:
        found = _INDEX.findall(f".{name}.")
        if len(found) != 1:
            raise InvalidInput(f"KV cache layer {name!r} does not name one layer index")
        index[name] = int(found[0])
    if sorted(index.values()) != list(range(num_layers)):
        raise InvalidInput(
            f"vLLM's KV cache layers {sorted(index.values())} are not the node's "
            f"{num_layers} layers 0..{num_layers - 1}"
        )
    return index


@dataclass
class _Load:
    op: LoadOp
    kv: torch.Tensor  # [L, 2, end - start, H, D]
    ok: torch.Tensor  # [end - start] bool: rows the node supplied


class WorkerSide:
    def __init__(
        self, node: NodeLink, layout: EngineLayout, block_size: int, packing: str | None
    ) -> None:
        self.node = node
        self.layout = layout
        self.block_size = block_size
        self._setting = packing  # kv_packing; the cache's, checked at register_kv_caches
        self._packing = ""
        self._pages: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self._loads: list[_Load] = []
        self._loaded_layers: set[int] = set()
        self._saves: dict[int, list[torch.Tensor | None]] = {}
        self._load_errors: set[int] = set()
        self.counters: dict[str, int] = {
            "rows_loaded": 0, "rows_missed": 0, "chunks_saved": 0, "stores_dropped_load_error": 0,
            "stores_dropped_layout_unconfirmed": 0,
        }  # fmt: skip

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], backends: Mapping[str, str]
    ) -> None:
        """``backends``: the attention backend's name of each layer vLLM registered (its
        ``static_forward_context``): the packing is decided here, not in a forward."""
        lay = self.layout
        self._index = layer_order(list(kv_caches), lay.num_layers)
        self._packing = backend_packing(
            self._setting, [backends[n] for n in kv_caches if n in backends]
        )
        self._pages = [torch.empty(0)] * lay.num_layers
        for name, page in kv_caches.items():
            want = (lay.num_kv_heads, self.block_size, 2 * lay.head_dim)
            if page.dim() != 4 or tuple(page.shape[1:]) != want:
                raise InvalidInput(
                    f"KV cache {name}: shape {tuple(page.shape)}, the node's layout needs "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}]"
                )
            self._pages[self._index[name]] = page

    def packing(self) -> str:
        """The cache's K/V packing (decided at :meth:`register_kv_caches`)."""
        assert self._packing, "KV caches used before register_kv_caches"
        return self._packing

    # -- loads ---------------------------------------------------------------------------

    def start_load_kv(self, meta: KvatlasConnectorMetadata) -> None:
        same = not meta.loads or self.node.same_layout(self.layout)
        self._loads = [self._fetch(op, same) for op in meta.loads]
        self._loaded_layers = set()

    def _fetch(self, op: LoadOp, same_layout: bool = True) -> _Load:
        lay, keys = self.layout, op.keys
        n = op.end - op.start
        kv = torch.zeros((lay.num_layers, 2, n, lay.num_kv_heads, lay.head_dim),
                         dtype=self._pages[0].dtype)  # fmt: skip
        ok = torch.zeros(n, dtype=torch.bool)
        tokens, salt, items = keys.token_ids(), keys.cache_salt, keys.mm_items

        def place(first: int, part: torch.Tensor) -> None:
            """Rows of ``part`` ``[L, 2, T, H, D]`` at request positions ``first, ...``."""
            lo, hi = max(first, op.start), min(first + part.shape[2], op.end)
            if lo < hi:
                kv[:, :, lo - op.start : hi - op.start] = part[:, :, lo - first : hi - first]
                ok[lo - op.start : hi - op.start] = True

        if op.prefix_hit > op.start and same_layout:
            # from the chunk holding op.start: vLLM holds the rows before it (its own prefix
            # cache), which the node would otherwise fetch and send for nothing
            first = op.start // lay.chunk_size
            nothing: tuple[list[Any], dict[str, int]] = ([], {})
            chunks, _ = self.node.call(
                "retrieve",
                lambda c: c.retrieve(
                    tokens, cache_salt=salt, request_id=keys.request_id, mm_items=items,
                    first_chunk=first,
                ),
                nothing,
            )  # fmt: skip
            for i, chunk in enumerate(chunks[: -(-op.prefix_hit // lay.chunk_size) - first],
                                      start=first):  # fmt: skip
                place(i * lay.chunk_size, from_numpy(chunk))
        if op.segments and same_layout:
            no_parts: dict[str, Any] = {"parts": []}
            got = self.node.call(
                "blend_retrieve",
                lambda c: c.blend_parts(
                    tokens, keys.request_id, op.segments, cache_salt=salt, mm_items=items
                ),
                no_parts,
            )  # fmt: skip
            for seg, part in got["parts"]:
                place(seg.cur_st, from_numpy(part))
        missed = int((~ok).sum())
        self.counters["rows_loaded"] += n - missed
        self.counters["rows_missed"] += missed
        if missed:
            blocks, _ = token_rows(op.block_ids, self.block_size, op.start, op.end)
            self._load_errors.update(int(b) for b in torch.unique(blocks[~ok]).tolist())
        return _Load(op, kv, ok)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._index.get(layer_name)
        if layer is None or layer in self._loaded_layers or not self._loads:
            return
        self._scatter(layer)

    def _scatter(self, layer: int) -> None:
        self._loaded_layers.add(layer)
        page, packing = self._pages[layer], self.packing()
        for load in self._loads:
            op = load.op
            blocks, rows = token_rows(op.block_ids, self.block_size, op.start, op.end)
            ok = load.ok
            scatter_rows(
                page, packing, self.layout.head_dim, blocks[ok], rows[ok], load.kv[layer][:, ok]
            )

    # -- saves ---------------------------------------------------------------------------

    def save_kv_layer(
        self, meta: KvatlasConnectorMetadata, layer_name: str, page: torch.Tensor
    ) -> None:
        layer = self._index.get(layer_name)
        if layer is None:
            return
        for i, op in enumerate(meta.stores):
            staged = self._saves.setdefault(i, [None] * self.layout.num_layers)
            staged[layer] = self._gather(op, page)

    def _gather(self, op: StoreOp, page: torch.Tensor) -> torch.Tensor:
        c = self.layout.chunk_size
        start, end = op.first_chunk * c, (op.first_chunk + op.n_chunks) * c
        blocks, rows = token_rows(op.block_ids, self.block_size, start, end)
        return gather_rows(page, self.packing(), self.layout.head_dim, blocks, rows)

    def wait_for_save(self, meta: KvatlasConnectorMetadata | None) -> None:
        late = [
            layer for layer in range(self.layout.num_layers) if layer not in self._loaded_layers
        ]
        if self._loads and late:
            log.error(
                "kvatlas connector: layers %s were never asked for (wait_for_layer_load); their "
                "rows are written now and reported as load errors (vLLM recomputes them)", late,
            )  # fmt: skip
            for layer in late:
                self._scatter(layer)
            for load in self._loads:
                blocks, _ = token_rows(
                    load.op.block_ids, self.block_size, load.op.start, load.op.end
                )
                self._load_errors.update(int(b) for b in torch.unique(blocks).tolist())
        self._loads = []
        if meta is not None:
            same = not meta.stores or self.node.same_layout(self.layout)
            for i, op in enumerate(meta.stores):
                if not same:
                    self.counters["stores_dropped_layout_unconfirmed"] += 1
                    continue
                if self._after_failed_load(op):
                    self.counters["stores_dropped_load_error"] += 1
                    continue
                self._send(op, self._saves.get(i, [None] * self.layout.num_layers))
        self._saves = {}

    def _after_failed_load(self, op: StoreOp) -> bool:
        """Whether ``op``'s chunks were computed over rows this step failed to load (its blocks
        up to the chunks' end hold one reported as a load error): their KV attended to rows
        that were never written, so it must not reach the node under its exact prefix key."""
        end = (op.first_chunk + op.n_chunks) * self.layout.chunk_size
        return not self._load_errors.isdisjoint(op.block_ids[: -(-end // self.block_size)])

    def _send(self, op: StoreOp, staged: list[torch.Tensor | None]) -> None:
        layers = [
            s if s is not None else self._gather(op, self._pages[layer])
            for layer, s in enumerate(staged)
        ]
        kv = torch.stack(layers)  # [L, 2, n * C, H, D]
        c, dtype = self.layout.chunk_size, self.layout.numpy_dtype()
        chunks = [to_numpy(kv[:, :, i * c : (i + 1) * c], dtype) for i in range(op.n_chunks)]
        keys = op.keys
        stored = self.node.call(
            "store",
            lambda client: client.store(
                keys.token_ids(), chunks, cache_salt=keys.cache_salt, request_id=keys.request_id,
                mm_items=keys.mm_items, first_chunk=op.first_chunk,
            ),
            0,
        )  # fmt: skip
        self.counters["chunks_saved"] += stored

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "node_failures": dict(self.node.failures)}
