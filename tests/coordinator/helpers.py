"""Wire builders shared by the coordinator HTTP tests.

Bodies are built as plain JSON-ready dicts (the wire contract of coordinator.md / directory.md
§1), not through the codecs, so a codec bug cannot hide behind a matching encoder.
"""

from __future__ import annotations

import base64
import itertools
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.asgi_thread import ThreadedServer
from kvatlas.coordinator.app import CoordinatorApp
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.keys import chunk_hashes, pack_kv_rank

CS = 4  # chunk size of every test server: small queries, same code paths
RANK1 = pack_kv_rank(1, 0, 1, 0)
_counter = itertools.count(1)


def metric_value(client: httpx.Client, name: str, **labels: str) -> float:
    """The sum of ``/metrics`` samples named ``name`` whose labels include ``labels`` (0 when
    none is exported yet)."""
    total = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


CACHE_COMMANDS = re.compile(
    r'^kvatlas_cache_commands\{kind="(\w+)",state="(\w+)"\} ([0-9.e+]+)$', re.M
)
"""One sample of ``kvatlas_cache_commands`` in a ``/metrics`` text: kind, state, count."""


def cache_commands(metrics_text: str) -> dict[tuple[str, str], float]:
    """The cache-control commands by ``(kind, state)`` in a ``/metrics`` text (zeros kept)."""
    return {(k, s): float(v) for k, s, v in CACHE_COMMANDS.findall(metrics_text)}


def cache_control_state(server: BackgroundServer) -> Any:
    """Pins, quotas and command counts of ``server``'s cache control (what a refused request
    must leave as it was)."""
    control = server.service.cache_control
    return (
        control.pins.rows(),
        control.quotas.default_limit_gb,
        control.quotas.limits(),
        control.commands.counts(),
    )


def fresh(prefix: str = "x") -> str:
    """A name no other test uses (tests share a server per module)."""
    return f"{prefix}-{next(_counter)}"


def fresh_tokens(n_chunks: int) -> list[int]:
    """Token ids of ``n_chunks`` full chunks, distinct from every other call's."""
    base = next(_counter) * 1_000_003
    return [(base + i) % (1 << 32) for i in range(n_chunks * CS)]


def b64(tokens: Sequence[int]) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode()


def hashes(tokens: Sequence[int]) -> list[bytes]:
    return chunk_hashes(list(tokens), CS)


def wire_key(
    h: bytes | str,
    model: str = "m",
    ws: int = 1,
    rank: int = 0,
    salt: str = "",
    group: int = 0,
) -> dict[str, Any]:
    return {
        "chunk_hash_hex": h if isinstance(h, str) else h.hex(),
        "model_name": model,
        "kv_rank": pack_kv_rank(ws, rank, ws, rank),
        "object_group_id": group,
        "cache_salt": salt,
    }


def wire_entry(
    key: dict[str, Any],
    size: int = 10,
    tokens: Sequence[int] | None = None,
    offset: int = -1,
) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "size_bytes": size, "token_offset": offset}
    if tokens is not None:
        out["token_ids"] = list(tokens)
    return out


def wire_batch(
    instance_id: str,
    incarnation: int,
    seq: int,
    event_type: str = "store",
    tier: str = "l1",
    backend: str = "dram",
    entries: Sequence[dict[str, Any]] = (),
    shared: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "incarnation": incarnation,
        "seq": seq,
        "event_type": event_type,
        "tier": tier,
        "backend": backend,
        "shared": shared,
        "ts": 0.0,
        "entries": list(entries),
        **extra,
    }


class Emitter:
    """Numbers batches like a real emitter: seq += 1 per batch within an incarnation."""

    def __init__(self, instance_id: str | None = None, incarnation: int = 1) -> None:
        self.instance_id = instance_id or fresh("inst")
        self.incarnation = incarnation
        self.seq = 0

    def batch(self, event_type: str = "store", **kw: Any) -> dict[str, Any]:
        self.seq += 1
        return wire_batch(self.instance_id, self.incarnation, self.seq, event_type, **kw)

    def store_chunks(
        self,
        tokens: Sequence[int],
        *,
        model: str = "m",
        salt: str = "",
        ws: int = 1,
        ranks: Sequence[int] | None = None,
        first_offset: int = 0,
        with_tokens: bool = True,
        n_chunks: int | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        """A store batch of the prefix chunks of ``tokens`` (all ranks unless ``ranks``)."""
        hs = hashes(tokens)[:n_chunks]
        entries = []
        for i, h in enumerate(hs):
            content = tokens[i * CS : (i + 1) * CS]
            for r in range(ws) if ranks is None else ranks:
                entries.append(
                    wire_entry(
                        wire_key(h, model, ws, r, salt),
                        size=100,
                        tokens=content if with_tokens else None,
                        offset=first_offset + i * CS,
                    )
                )
        return self.batch("store", entries=entries, **kw)


def post_batches(client: httpx.Client, *batches: dict[str, Any], **kw: Any) -> httpx.Response:
    return client.post("/events", json={"batches": list(batches)}, **kw)


def stats(client: httpx.Client, **kw: Any) -> dict[str, Any]:
    r = client.get("/directory/stats", **kw)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def lookup_tokens(client: httpx.Client, tokens: Sequence[int], **body: Any) -> dict[str, Any]:
    r = client.post(
        "/directory/lookup", json={"token_ids": list(tokens), "model_name": "m", **body}
    )
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def holders(reply: dict[str, Any]) -> dict[tuple[Any, str, str, bool], int]:
    """The prefix summary as ``{(instance_id, tier, backend, shared): chunks}``."""
    return {
        (p["instance_id"], p["tier"], p["backend"], p["shared"]): p["chunks"]
        for p in reply["prefix"]
    }


def placements_by_key(reply: dict[str, Any]) -> list[set[tuple[str, str, str]]]:
    return [
        {(p["instance_id"], p["tier"], p["backend"]) for p in r["placements"]}
        for r in reply["results"]
    ]


def assert_error(r: httpx.Response, *statuses: int) -> dict[str, Any]:
    """A 4xx (one of ``statuses``) with a JSON body whose ``detail`` is a non-empty string."""
    assert r.status_code in statuses, (r.status_code, r.text)
    body: dict[str, Any] = r.json()
    assert isinstance(body.get("detail"), str) and body["detail"], body
    return body


@contextmanager
def running(
    clock: Callable[[], float] = time.monotonic, **config: Any
) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    """A coordinator on a free loopback port, and a client for it (``clock`` times heartbeats)."""
    config.setdefault("chunk_size", CS)
    with (
        BackgroundServer(CoordinatorConfig(port=free_port(), **config), clock) as server,
        httpx.Client(base_url=server.url, timeout=30.0) as client,
    ):
        yield server, client


@contextmanager
def serving(app: CoordinatorApp) -> Iterator[httpx.Client]:
    """A client of ``app`` served on a free loopback port."""
    server = ThreadedServer(app, port=free_port())
    server.start()
    try:
        with httpx.Client(base_url=server.url) as client:
            yield client
    finally:
        server.stop()
