"""One way to name a workload: ``rag:...`` (the generator) or a path (a Mooncake trace)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvatlas.errors import InvalidInput
from kvatlas.workloads.mooncake import TraceRequest, read_mooncake
from kvatlas.workloads.rag import PREFIX, generate_rag, parse_rag


def open_workload(source: str, requests: int | None = None) -> Iterator[TraceRequest]:
    """The first ``requests`` requests of ``source`` (a trace: all when ``None``; the
    generator needs a count)."""
    if source.startswith(PREFIX):
        if requests is None:
            raise InvalidInput("a rag: workload needs a request count")
        return generate_rag(parse_rag(source), requests)
    path = Path(source)
    if not path.is_file():
        raise InvalidInput(f"no trace file at {source!r} (and not a rag: spec)")
    return read_mooncake(path, requests)
