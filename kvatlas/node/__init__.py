"""Cache node: KV chunk tiers, event emitter, local matcher, unified lookup, retrieval, re-RoPE."""
