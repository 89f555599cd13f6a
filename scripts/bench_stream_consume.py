"""In-process consume over the Redis stream: the consumer's apply step (attribute, decode,
entry count, ingest through the service's admission and the gate, position, acknowledgement)
for every entry of a stream, without Redis (the acknowledgements go to a stand-in). The
stream carries the ``bench directory`` workload (token-bearing L1 stores of 256-token chunks,
Llama 3 vocabulary, blend on), ``--batches-per-entry`` batches of 256 entries per stream
entry, in the sink's format (``--fmt``). Prints the median over ``--repeats`` (a fresh
service each) of the time per cache entry (wall and this thread's CPU) and the rate. Runs against whatever ``kvatlas``
is on ``PYTHONPATH``: run it in two trees, interleaved, to compare them.

    PYTHONPATH=$PWD python scripts/bench_stream_consume.py --entries 100000 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvatlas.bench.directory import _workload
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.stream_consumer import StreamConsumer
from kvatlas.events.stream_format import encode_stream_fields


class _Acks:
    def xack(self, stream: str, group: str, entry_id: bytes) -> None:
        pass


def consume_seconds(fields: list[dict[bytes, bytes]]) -> tuple[float, float]:
    """Seconds (wall, this thread's CPU) to apply every stream entry of ``fields`` to a
    fresh service."""
    config = CoordinatorConfig(
        chunk_size=256,
        enable_blend_lookup=True,
        event_transport="redis",
        redis_url="redis://127.0.0.1:1/0",  # never reached
    )
    service = CoordinatorService(config)
    consumer = StreamConsumer(
        config,
        attribute=lambda f: None,
        ingest=service.ingestion.ingest_as,
        position=None,
        on_position=lambda position: None,
        set_readiness=lambda state: None,
        stop=service._stop,
        errors=service.metrics.stream_errors,
        rejected=service.metrics.stream_rejected,
    )
    consumer.client = _Acks()  # type: ignore[assignment]
    ids = [f"{i + 1}-0".encode() for i in range(len(fields))]
    gc.collect()
    start, cpu = time.perf_counter(), time.thread_time()
    for entry_id, f in zip(ids, fields, strict=True):
        consumer._apply(entry_id, f)
    took = time.perf_counter() - start, time.thread_time() - cpu
    assert consumer.applied_entries == len(fields), (consumer.applied_entries, consumer.bad_entries)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--batches-per-entry", type=int, default=1)
    parser.add_argument("--fmt", choices=("msgpack", "json"), default="msgpack")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batches = _workload(args.entries, args.seed)
    per = args.batches_per_entry
    fields = [
        encode_stream_fields(batches[i : i + per], args.fmt) for i in range(0, len(batches), per)
    ]
    consume_seconds(fields[:4])  # warm-up (compiled kernels)
    runs = [consume_seconds(fields) for _ in range(args.repeats)]
    wall = statistics.median(w for w, _ in runs)
    cpu = statistics.median(c for _, c in runs)
    print(
        f"stream consume {args.entries:,} entries ({len(fields):,} stream entries, {args.fmt}): "
        f"median {wall * 1e6 / args.entries:.2f} µs/entry wall, {args.entries / wall / 1e3:,.0f}k "
        f"entries/s; thread CPU {cpu * 1e6 / args.entries:.2f} µs/entry "
        f"(runs, wall: {', '.join(f'{w:.3f}' for w, _ in runs)} s)"
    )


if __name__ == "__main__":
    main()
