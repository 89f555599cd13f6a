"""The help text of every ``kvatlas node`` flag (:class:`kvatlas.node.config.NodeConfig`'s
fields, by field name): what ``kvatlas node --help`` prints, beside the configuration they
describe (``tests/test_cli_help.py`` fails for a flag without one)."""

from __future__ import annotations

from kvatlas.http_limits import BODY_TIMEOUT_HELP, HEADER_TIMEOUT_HELP, MAX_CONNECTIONS_HELP

HELP = {
    "model_name": "model name; part of every key (nodes of different models never share KV)",
    "hf_config": (
        "a Hugging Face config.json (or its directory): the KV layout flags below default to "
        "what it states; a flag that contradicts it is refused, one it does not state must "
        "be given"
    ),
    "num_layers": (
        "KV layout: transformer layers (the model's num_hidden_layers; required unless "
        "--hf-config states it)"
    ),
    "num_kv_heads": "KV layout: KV heads per layer (on this rank; required unless --hf-config)",
    "head_dim": "KV layout: dims per head (required unless --hf-config states it)",
    "chunk_size": "tokens per chunk; must equal the coordinator's --chunk-size",
    "dtype": "KV cache dtype (the engine's KV cache dtype; default float16)",
    "rope_style": (
        "RoPE pairing for re-RoPE: rotate-half (neox) or interleaved (gptj) (default neox)"
    ),
    "rotary_dim": "leading dims of each head that RoPE rotates (0 = all of head_dim, the default)",
    "rope_theta": "RoPE frequency base (default 10000)",
    "hash_scheme": "key scheme (chunk hash); must equal the coordinator's",
    "world_size": "tensor-parallel world size (packed into every key's kv_rank)",
    "rank": "this node's tensor-parallel rank",
    "instance_id": (
        "instance id (not set: assigned by the coordinator, or generated without one: a new id, "
        "hence a new L2 subdirectory, on every start; set it to keep a node's L2 across restarts)"
    ),
    "engine_id": (
        "id of the engine whose KV connector this node is (its KV-events id, the router's "
        "--engine ID); said at registration so that POST /route/score counts this node's "
        "copies as that engine's own (not set: none)"
    ),
    "host": "bind address of the peer L1 and engine API (loopback by default)",
    "port": "bind port of the peer L1 and engine API",
    "advertised_url": "URL peers use for this node's L1 (default http://host:port)",
    "l1_bytes": "L1 (node memory) budget in bytes",
    "l2": "L2 tier: a directory (fs), a Redis (redis) or none",
    "l2_path": (
        "directory of the fs L2 (a per-instance subdirectory unless --l2-shared; default "
        "$XDG_CACHE_HOME/kvatlas/l2 or ~/.cache/kvatlas/l2)"
    ),
    "l2_redis_url": "Redis URL of the redis L2, e.g. redis://127.0.0.1:6379/0",
    "l2_write": "write L2 on every store (through) or when a chunk leaves L1 (evict: evicted, "
    "or refused by an L1 full of pinned or held chunks)",
    "l2_shared": "the fs L2 directory is mounted by every node: a fleet-wide pool",
    "coordinator_url": "coordinator base URL (not set: no fleet: local tiers and matcher only)",
    "coordinator_event_reporting": "report cache events (required for fleet matching)",
    "coordinator_blend_timeout": "seconds a blend lookup waits for the fleet leg",
    "coordinator_token": (
        "bearer token for the coordinator (not set: none); visible in the process list as a "
        "flag: prefer --coordinator-token-file or the environment"
    ),
    "coordinator_token_file": "file holding the coordinator token (mode 600, >= 32 characters)",
    "event_transport": "how events travel: POST /events (http) or Redis Streams (redis)",
    "redis_url": "Redis URL for the redis event transport",
    "event_stream": "Redis Stream name carrying event batches (the redis transport)",
    "stream_max_len": "approximate cap (MAXLEN ~) on the event stream's entries, per XADD",
    "digest_interval_s": "seconds between inventory digest exchanges with the coordinator",
    "heartbeat_interval_s": (
        "seconds between heartbeats (each followed by the value report); keep it well under "
        "the coordinator's --instance-timeout"
    ),
    "enable_blend_lookup": (
        "blend (fragment) lookup; the coordinator's flag of the same name; the node accepts "
        "it but currently always answers blend lookups"
    ),
    "allow_trim": "trim a blend match that straddles the prefix boundary instead of dropping it",
    "prefer_cheaper": "among overlapping blend matches prefer the cheaper copy (local L1 first)",
    "token_cache_chunks": "chunks whose tokens are kept to stamp later events (0 = none)",
    "auth_token_file": (
        "JSON token file (the coordinator's format): /engine/* needs an engine token bound to "
        "the call's cache_salt, /peer/* a peer token (default: no auth)"
    ),
    "engine_host": "bind address of the engine API when --engine-port is given (default --host)",
    "engine_port": "serve /engine/* only on this port and /peer/* only on --port (default: both)",
    "peer_token": "the fleet's peer secret (prefer the file or env): each /peer/* call sends a "
    "credential derived from it for its target; it also signs this node's advertised URL",
    "peer_token_file": "file holding the fleet's peer secret (mode 600, >= 32 characters)",
    "max_query_tokens": "largest request, in tokens, the engine API accepts",
    "max_body_bytes": (
        "largest /engine/store body in bytes (default: one request's KV for --max-query-tokens "
        "tokens)"
    ),
    "tracker_memory_bytes": "memory budget of the request trackers kept between engine calls",
    "peer_fetch_deadline_s": "seconds one fetch from a peer may take in all, however it drips",
    "fleet_refresh_interval_s": "seconds between re-reads of the coordinator's instance list",
    "pin_refresh_interval_s": "seconds between reads of this node's pins from the coordinator",
    "public_metrics": "serve /metrics without a token (default: only when auth is off)",
    "public_docs": "serve /docs and /openapi.json without a token (default: only when auth is off)",
    "l2_max_bytes": (
        "byte cap of a private fs L2: least recently used chunks are evicted (and reported) "
        "beyond it; 0 = no cap; a shared pool (--l2-shared) is capped by whoever provisions it"
    ),
    "l2_redis_ttl": "seconds a chunk written to the redis L2 lives (0 = no expiry)",
    "l2_redis_sweep_interval_s": (
        "seconds between checks that this node's redis L2 keys still exist (expired or evicted "
        "keys are reported as deletes; keyspace notifications are used too when on)"
    ),
    "coordinator_retry_max_s": (
        "longest wait, in seconds, between attempts to reach a coordinator that is not up yet"
    ),
    "log_level": "log level",
    "log_format": "log lines as JSON objects (json) or plain text for humans (text)",
    "access_log": "log one line per HTTP request (engine calls included)",
    "http_header_timeout_s": HEADER_TIMEOUT_HELP,
    "http_body_timeout_s": BODY_TIMEOUT_HELP,
    "http_max_connections": MAX_CONNECTIONS_HELP,
}
