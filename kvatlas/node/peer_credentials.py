"""Peer credentials: what a node presents to another node's ``/peer/kv``, and how it knows
that a peer URL the coordinator lists came from a node. The fleet's one shared secret
(``--peer-token-file``) never leaves a node; everything on the wire is derived from it:

* the **credential** for target instance ``T`` is ``HMAC-SHA256(secret, "kvatlas peer
  credential v1" NUL T)`` (hex). ``T`` accepts only its own, so one captured by a peer (or on
  the way to it) opens no other node;
* the **URL signature** of instance ``I`` at URL ``U`` is ``HMAC-SHA256(secret, "kvatlas peer
  url v1" NUL I NUL U)`` (hex). A node registers it beside its ``p2p_advertised_url``, and a
  node holding the secret calls a listed URL (credential or not) only when its signature
  verifies: a caller who holds no secret (an emit token alone, an engine, an LMCache
  instance) cannot make nodes call its server, and a URL signed for one instance is no URL
  of another.

The two domains never overlap (a signature, which the coordinator shows to salt-bound
tokens, is no credential). See ``docs/security.md`` ("Peer credentials").
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

__all__ = ["PeerSecret"]

_CREDENTIAL: Final = b"kvatlas peer credential v1\0"
_URL: Final = b"kvatlas peer url v1\0"


def _canonical(url: str) -> bytes:
    """A URL as signed and checked: without trailing slashes (peers strip them too)."""
    return url.rstrip("/").encode("utf-8")


class PeerSecret:
    """The fleet's peer secret and what is derived from it (module docstring)."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the peer secret must not be empty")
        self._key = secret.encode("utf-8")

    def _mac(self, domain: bytes, *parts: bytes) -> str:
        return hmac.new(self._key, domain + b"\0".join(parts), hashlib.sha256).hexdigest()

    def credential(self, instance_id: str) -> str:
        """The bearer token this node sends to instance ``instance_id`` (and only to it)."""
        return self._mac(_CREDENTIAL, instance_id.encode("utf-8"))

    def accepts(self, bearer: str, instance_id: str) -> bool:
        """Whether ``bearer`` is the credential for ``instance_id`` (constant time)."""
        return hmac.compare_digest(bearer.encode("utf-8"), self.credential(instance_id).encode())

    def sign_url(self, instance_id: str, url: str) -> str:
        """The signature a node registers beside its ``p2p_advertised_url``."""
        return self._mac(_URL, instance_id.encode("utf-8"), _canonical(url))

    def url_signed(self, instance_id: str, url: str, signature: str | None) -> bool:
        """Whether ``signature`` is this secret's for ``instance_id`` at ``url``."""
        if not signature:
            return False
        expected = self.sign_url(instance_id, url).encode()
        return hmac.compare_digest(signature.encode("utf-8"), expected)
