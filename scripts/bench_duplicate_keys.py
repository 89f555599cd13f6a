"""What refusing a JSON key given twice would cost on the hot routes: this thread's CPU to
decode a body as the route does, against :func:`kvatlas.fields.check_unique_keys` (the check
the cache-control, quota and registration routes make: a second parse by the standard
library's C scanner). Bodies: ``POST /events`` JSON of 256 store entries of 256 Llama 3 ids
(one batch), a blend lookup of 32k ids in ``tokens_b64``, a prefix lookup of 32k ``token_ids``;
and, for the routes that make the check, the largest pin body (1,000,000 ``token_ids``).
The median of ``--repeats`` calls each (docs/performance.md, "Service: tried and not kept").

    PYTHONPATH=$PWD python scripts/bench_duplicate_keys.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from kvatlas.api.cache_control import MAX_TOKEN_IDS, TokenFields
from kvatlas.bench.ingest_bodies import store_batches
from kvatlas.coordinator.query import decode_blend_lookup, decode_lookup_body
from kvatlas.events import decode_json_columns, encode_json
from kvatlas.fields import check_unique_keys, decode_fields
from kvatlas.workloads import LLAMA3, random_token_ids

QUERY_TOKENS = 32_768


def _cpu(call: Callable[[], object], repeats: int) -> float:
    call()  # compiled kernels, first allocations
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches, _ = store_batches(rng, 256, 256, "inst")
    events = encode_json(batches)
    query = random_token_ids(rng, (QUERY_TOKENS,), LLAMA3)
    b64 = base64.b64encode(np.asarray(query, "<u4").tobytes()).decode()
    blend = json.dumps({"tokens_b64": b64, "model_name": "m"}).encode()
    lookup = json.dumps({"token_ids": query.tolist(), "model_name": "m"}).encode()
    ids = random_token_ids(rng, (MAX_TOKEN_IDS,), LLAMA3).tolist()
    pin = json.dumps({"model_name": "m", "world_size": 1, "token_ids": ids}).encode()
    rows = [
        ("POST /events, 256 entries", events, lambda: decode_json_columns(events), 256),
        ("blend lookup, 32k ids", blend, lambda: decode_blend_lookup(blend, 2_000_000), 1),
        ("prefix lookup, 32k ids", lookup, lambda: decode_lookup_body(lookup, 2_000_000, 1), 1),
        ("pin, 1M ids (checked)", pin, lambda: decode_fields(pin, TokenFields), 1),
    ]
    print(f"{'body':<28}{'bytes':>10}{'decode':>12}{'check':>12}{'ratio':>8}")
    for name, raw, decode, per in rows:
        decoded = _cpu(decode, args.repeats)
        checked = _cpu(partial(check_unique_keys, raw), args.repeats)
        unit = "us/entry" if per > 1 else "us"
        print(
            f"{name:<28}{len(raw):>10,}{decoded / per * 1e6:>9.2f} {unit:<3}"
            f"{checked / per * 1e6:>9.2f} {unit:<3}{checked / decoded:>7.1f}x"
        )


if __name__ == "__main__":
    main()
