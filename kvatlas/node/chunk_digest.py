"""What a fetched chunk must prove before its KV is used: it is the requested key, and its
tokens are the request's tokens at that position.

A chunk that comes from anywhere but this request's own computation (a peer, a shared L2
pool, this node's L2, even its L1) may be stale, foreign or forged; a matching hash alone
proves nothing, since anyone who can publish a placement can serve bytes under any key. Wrong
KV does not fail loudly, it makes the model attend to garbage: so a chunk that cannot prove
both facts is a miss, whatever its source.

A peer never sends token ids (they would leak one tenant's prompt to another): it sends
:func:`tokens_digest` of them, the requester compares it with the digest of its own tokens.
Both sides compute the digest here, so they cannot drift apart (docs/node.md).
"""

from __future__ import annotations

from typing import Final

import blake3
import numpy as np

from kvatlas.keys import ObjectKey, TokenArray
from kvatlas.node.stored_chunk import StoredChunk

TOKENS_DIGEST_BYTES: Final = 32

REJECTED_FOREIGN_KEY: Final = "rejected_foreign_key"
"""The chunk carries a key other than the one asked for."""
REJECTED_TOKEN_MISMATCH: Final = "rejected_token_mismatch"
"""Its tokens (or their digest) differ from the request's tokens at that position."""
REJECTED_NO_TOKENS: Final = "rejected_no_tokens"
"""It carries neither token ids nor a digest of them: nothing to check it against."""


def tokens_digest(tokens: TokenArray) -> bytes:
    """blake3 (32 bytes) of ``tokens`` as little-endian uint32 bytes: the wire's
    ``tokens_digest``."""
    return blake3.blake3(np.ascontiguousarray(tokens, dtype="<u4").view(np.uint8).data).digest()


def rejection(
    wanted: ObjectKey, chunk: StoredChunk, digest: bytes | None, window: TokenArray
) -> str | None:
    """Why ``chunk`` must not serve ``wanted`` at the position whose tokens are ``window``,
    or ``None`` when it may. ``digest`` is the sender's :func:`tokens_digest` of the chunk's
    tokens (a peer reply); the chunk's own tokens, when it carries them, take precedence."""
    if chunk.key != wanted:
        return REJECTED_FOREIGN_KEY
    if chunk.tokens is not None:
        same = chunk.tokens.shape == window.shape and bool(np.array_equal(chunk.tokens, window))
    elif digest is not None:
        same = digest == tokens_digest(window)
    else:
        return REJECTED_NO_TOKENS
    return None if same else REJECTED_TOKEN_MISMATCH
