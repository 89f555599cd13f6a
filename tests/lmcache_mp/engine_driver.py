"""An engine for a real ``lmcache server``, run with the LMCache test environment's Python.

LMCache 0.5.6's MP server answers ``POST /cache/prefetches`` only for a model whose KV cache an
engine has registered, and holds KV only when an engine stores it. On a CPU-only machine its
own benchmark client (``lmcache bench server --mode cpu``) is such an engine: it registers CPU
KV tensors over POSIX shared memory and stores through the ZMQ request port. This script uses
that client to register, store the requested sequences, print one JSON line (the chunk size,
the model, each sequence's token ids), and stay registered until its stdin closes, so the
test can then drive the server's HTTP routes. Run by ``tests/lmcache_mp/server.py``; it
imports LMCache, so it never runs in the project's own environment.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rpc-url", required=True)
    parser.add_argument("--http-url", required=True)
    parser.add_argument("--num-tokens", type=int, required=True)
    parser.add_argument("--sequences", type=int, nargs="+", required=True)
    args = parser.parse_args()

    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig
    from lmcache.cli.commands.bench.server_bench.helpers import _MODEL_NAME

    config = BenchConfig(
        rpc_url=args.rpc_url,
        http_url=args.http_url,
        mode="cpu",
        transfer_mode="lmcache_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=args.num_tokens,
        kvcache_shape_spec="(2,64,16,2,16):float16:2",
        num_blocks=64,
        block_size=16,
    )
    client = ServerBenchClient(config, log=lambda line: print(line, file=sys.stderr))
    client.start()
    try:
        stored = []
        for seq in args.sequences:
            request = client.create_request(seq, f"kvatlas-{seq}", "store")
            if request is None:
                raise SystemExit(f"sequence {seq}: fewer tokens than one chunk")
            result = client.store(request, 0, request.num_full_tokens)
            if result is None or result.failed_worker_ranks:
                raise SystemExit(f"sequence {seq}: store failed ({result})")
            client.end_session(request)
            stored.append({"sequence": seq, "token_ids": list(request.token_ids)})
        reply = {"chunk_size": request.chunk_size, "model_name": _MODEL_NAME, "stored": stored}
        print(json.dumps(reply), flush=True)
        sys.stdin.read()  # registered until the test closes our stdin
    finally:
        client.close()


if __name__ == "__main__":
    main()
