"""Who a Redis stream entry speaks for: the principal whose stream key signed it.

The stream carries no bearer token, and anyone who may ``XADD`` to it writes entries that
look alike. With auth on, an entry counts only as the principal of the token whose key
verifies its MAC (:mod:`kvatlas.events.stream_format`, :func:`kvatlas.auth.stream_key`), and
that principal then passes exactly the checks of ``POST /events`` (its instances, its salts):
an emit credential for node X never produces entries attributed to node Y. The MAC is checked
before the entry is decoded. Without auth every entry is trusted, as every HTTP caller is.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvatlas.auth import Principal, TokenAuth
from kvatlas.errors import Unauthorized
from kvatlas.events.stream_format import mac_valid, signing_key_id


class UnsignedEntry(Unauthorized):
    """An entry without a key id and MAC, on a coordinator with auth on."""


class BadSignature(Unauthorized):
    """An entry whose key id no token derives, or whose MAC its key does not give (tampered
    data, another stream's entry, a revoked token)."""


def entry_principal(
    auth: TokenAuth | None, fields: Mapping[bytes, bytes], stream: str
) -> Principal | None:
    """The principal an entry of ``stream`` speaks for (``None``: auth off, trusted), or
    :class:`UnsignedEntry` / :class:`BadSignature`."""
    if auth is None:
        return None
    key_id = signing_key_id(fields)
    if key_id is None:
        raise UnsignedEntry("stream entry is not signed (no kid/mac): its node needs a token")
    found = auth.stream_signer(key_id)
    if found is None:
        raise BadSignature(f"stream entry signed with unknown key id {key_id[:16]!r}")
    key, who = found
    if not mac_valid(fields, stream, key.key_id, key.secret):
        raise BadSignature(f"stream entry MAC does not verify (key id {key_id.decode()})")
    return who


__all__ = ["BadSignature", "UnsignedEntry", "entry_principal"]
