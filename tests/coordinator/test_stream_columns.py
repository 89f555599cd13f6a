"""The Redis stream path decodes each entry into columns (``decode_stream_columns``) instead of
one object per cache entry; the per-entry path it replaced is the oracle (differential): the
same random stream entries — valid bodies (JSON, compact msgpack, JSON-shaped msgpack) of
store, delete, access, config and resync batches over several instances, salts and models;
broken bodies; entries without data or in an unknown format; entries over
``--max-batch-entries``; entries whose signer may not speak for their instance or salt; a bad
signature; an emitter past ``--max-instances`` — read by the consumer, leave identical
directories (placements, bound tokens, counts, cursors, blend answers), identical consumer
counts and metrics (applied, bad, refused by reason) and identical positions and
acknowledgements. A refused or malformed entry is counted and skipped alone: its neighbours
are applied (the oracle says which)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from kvatlas.auth import Principal
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.query import check_entry_count
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.stream_consumer import StreamConsumer
from kvatlas.errors import Conflict, Forbidden, InvalidInput, Unauthorized
from kvatlas.events import ColumnBatch, EventDecodeError, EventValidationError
from kvatlas.events.stream_format import decode_stream_fields
from tests.directory.test_columnar_ingest import (
    CHUNK,
    JSON_BREAKS,
    PACKED_BREAKS,
    _json_body,
    _packed_body,
    _state,
    batch_st,
)

SIGNERS: dict[bytes, Principal | None] = {
    b"": None,  # auth off
    b"node-a": Principal("node-a", frozenset({"emit"}), frozenset({"a"}), frozenset({""})),
    b"admin": Principal("admin", frozenset({"admin"})),
}


class Acks:
    """The consumer's Redis, as far as applying entries goes: acknowledgements, in order."""

    def __init__(self) -> None:
        self.acked: list[bytes] = []

    def xack(self, stream: str, group: str, entry_id: bytes) -> None:
        self.acked.append(entry_id)


class PerEntryConsumer(StreamConsumer):
    """The consumer before columns: each entry decoded into objects (verbatim but for the
    decoder and the conversion the old ``ingest_as`` made)."""

    def _apply(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            who = self._attribute(fields)
            batches = decode_stream_fields(fields)
        except Unauthorized as exc:
            self._refuse(entry_id, exc)
        except (EventDecodeError, EventValidationError):
            self.bad_entries += 1
            self._errors.labels("decode").inc()
        else:
            try:
                check_entry_count(batches, self.max_entries)
                self._ingest(who, [ColumnBatch.of(b) for b in batches])
            except (InvalidInput, Forbidden, Conflict) as exc:
                self._refuse(entry_id, exc)
            else:
                self.applied_entries += 1
        self.position = entry_id.decode()
        self._on_position(self.position)
        self.client.xack(self.stream, self.group, entry_id)


def _attribute(fields: Any) -> Principal | None:
    signer = fields.get(b"signer", b"")
    if signer == b"forged":
        raise Unauthorized("stream entry signature does not verify")
    return SIGNERS[signer]


def _run(
    kind: type[StreamConsumer], config: CoordinatorConfig, entries: Sequence[dict[bytes, bytes]]
) -> Any:
    service = CoordinatorService(config)
    positions: list[str] = []
    metrics = service.metrics
    consumer = kind(
        config,
        attribute=_attribute,
        ingest=service.ingestion.ingest_as,
        position=None,
        on_position=positions.append,
        set_readiness=lambda state: None,
        stop=service._stop,
        errors=metrics.stream_errors,
        rejected=metrics.stream_rejected,
    )
    consumer.client = acks = Acks()  # type: ignore[assignment]
    for i, fields in enumerate(entries):
        consumer._apply(f"{i + 1}-0".encode(), fields)
    exported = [
        line
        for line in generate_latest(metrics.registry).decode().splitlines()
        if not line.startswith(("#", "kvatlas_gc_"))
        and "_created" not in line
        and "seconds" not in line
    ]
    counts = (consumer.applied_entries, consumer.bad_entries, consumer.rejected_entries)
    return _state(service.directory), counts, exported, positions, acks.acked


@st.composite
def stream_entry(draw: st.DrawFn) -> dict[bytes, bytes]:
    batches = draw(st.lists(batch_st(), min_size=1, max_size=3))
    fmt = draw(st.sampled_from(["json", "msgpack", "json-shaped msgpack"]))
    breaks: list[Any] = PACKED_BREAKS if fmt == "msgpack" else JSON_BREAKS
    brk = draw(st.none() | st.none() | st.sampled_from(breaks))
    at = draw(st.integers(0, 20))
    if fmt == "msgpack":
        fields = {b"fmt": b"msgpack", b"data": _packed_body(batches, brk, at)}
    else:
        body = _json_body(batches, brk, at)
        if fmt == "json-shaped msgpack":
            fields = {
                b"fmt": b"msgpack",
                b"data": msgspec.msgpack.encode(msgspec.json.decode(body)),
            }
        else:
            fields = {b"fmt": b"json", b"data": body}
    odd = draw(st.sampled_from(["", "", "", "", "no data", "fmt", "garbage", "truncated"]))
    if odd == "no data":
        del fields[b"data"]
    elif odd == "fmt":
        fields[b"fmt"] = b"xml"
    elif odd == "garbage":
        fields[b"data"] = b"\xc1{not a body"
    elif odd == "truncated":
        fields[b"data"] = fields[b"data"][: len(fields[b"data"]) // 2]
    fields[b"signer"] = draw(st.sampled_from([b"", b"", b"node-a", b"admin", b"forged"]))
    return fields


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.lists(stream_entry(), min_size=1, max_size=8),
    max_entries=st.sampled_from([6, 32_768]),
    max_instances=st.sampled_from([1, 10]),
)
def test_stream_columns_equal_per_entry_path(
    entries: list[dict[bytes, bytes]], max_entries: int, max_instances: int
) -> None:
    config = CoordinatorConfig(
        chunk_size=CHUNK,
        enable_blend_lookup=True,
        event_transport="redis",
        redis_url="redis://127.0.0.1:1/0",  # never reached: only entries are applied
        max_batch_entries=max_entries,
        max_instances=max_instances,
    )
    assert _run(StreamConsumer, config, entries) == _run(PerEntryConsumer, config, entries)
