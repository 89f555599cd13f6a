"""Bearer-token auth shared by the coordinator and the cache node.

A token carries a set of **roles**, each with its bindings:

========  =====================================================  ==========================
role      may                                                    bound to
========  =====================================================  ==========================
emit      register, heartbeat, post events for an instance       ``instance_ids``, ``cache_salts``
lookup    query the directory (prefix, keys, blend)               ``cache_salts``
engine    call a node's engine API (store, lookup, retrieve)      ``cache_salts``
peer      call a node's peer API (fetch KV for a fleet member)    nothing
route     send requests through ``kvatlas router``                 ``cache_salts``
cache     cache control: pins, deletes, prefetches, quotas        ``cache_salts``
admin     everything (listings, deregistering anyone)             nothing
========  =====================================================  ==========================

An absent binding means "any"; ``[]`` means none. A node runs with one token holding
``["emit", "lookup"]`` for its own instance and its tenants' salts: no admin token is needed
anywhere in a fleet.

Token file (JSON)::

    {"tokens": [
        {"token": "<32+ chars>", "roles": ["emit", "lookup"], "instance_ids": ["node-a"],
         "cache_salts": ["tenant-a"]},
        {"token": "<32+ chars>", "roles": ["engine"], "cache_salts": ["tenant-a"]},
        {"token": "<32+ chars>", "roles": ["peer"]},
        {"token": "<32+ chars>", "role": "admin"}
    ]}

``"role": "x"`` is accepted as ``"roles": ["x"]``, ``"name"`` names the principal (for the
logs); any other field is refused, as is a token listed twice. Tokens are compared by SHA-256 digest
(a dictionary lookup on a digest leaks nothing useful about the token through timing).

A token also yields a **stream key** (:func:`stream_key`): the key its holder signs Redis
stream entries with, so that the coordinator attributes each entry to the token's principal
(the stream carries no bearer token; ``kvatlas.events.stream_format`` computes the MAC).

One rule for both services (:func:`check_private`, :data:`MIN_TOKEN_CHARS`,
:data:`DOCS_PATHS`, :func:`public_unless_auth`): a file holding secrets that group or others
may access is refused, a token shorter than 32 characters is refused, and what auth leaves
public (metrics, API docs) is decided the same way on the coordinator and the node.

Failures are :class:`kvatlas.errors.Unauthorized` (401: no or unknown token) and
:class:`kvatlas.errors.Forbidden` (403: a known token outside its roles, instances or salts).
Threat model: ``docs/security.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from kvatlas.errors import Forbidden, Unauthorized

log = logging.getLogger(__name__)

ROLES = ("emit", "lookup", "engine", "peer", "admin", "route", "cache")
_SALT_VERBS = {"lookup": "query", "emit": "store for", "route": "route"}
MIN_TOKEN_CHARS = 32
"""Shortest token either service accepts (in a token file, a token file of its own, the
environment or a flag): below it a token is refused, not warned about."""
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""A service's API documentation: with auth on, any valid token reads it unless
``--public-docs``."""


def public_unless_auth(auth_on: bool, public: bool | None) -> bool:
    """``--public-metrics`` / ``--public-docs``: the flag when given, else public exactly
    when auth is off."""
    return (not auth_on) if public is None else public


def check_private(path: Path, what: str) -> None:
    """Refuse a secrets file that group or others may access (``chmod 600`` it)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ValueError(
            f"{what}: {path} is accessible to group or others (mode {mode & 0o777:o}); chmod 600 it"
        )


def check_secret(token: str, what: str) -> str:
    """Refuse a token shorter than :data:`MIN_TOKEN_CHARS` (an empty one means "none")."""
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what}: a token must have >= {MIN_TOKEN_CHARS} characters")
    return token


def read_secret_file(path: Path, what: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped); refused when the file is
    accessible to group or others or the token is too short."""
    check_private(path, what)
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"{what}: {path} is empty")
    return check_secret(text, f"{what} {path}")


def read_secret(value: str | None, path: Path | None, flag: str) -> str | None:
    """A secret given as ``flag`` (``value``: the command line or ``KVATLAS_<NAME>``) or in
    the file of ``flag``-file (``path``), by the rule above: the file's by
    :func:`read_secret_file`, the value's by :func:`check_secret`; ``None`` when neither is
    given; both at once is refused."""
    if value and path is not None:
        raise ValueError(f"give {flag}-file or the token, not both")
    if path is not None:
        return read_secret_file(path, f"{flag}-file")
    return check_secret(value, flag) or None if value else None


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name, roles and bindings (``None`` = unbound, i.e. any)."""

    name: str
    roles: frozenset[str]
    instance_ids: frozenset[str] | None = None
    cache_salts: frozenset[str] | None = None

    @property
    def is_admin(self) -> bool:
        return "admin" in self.roles

    def may(self, *roles: str) -> bool:
        return self.is_admin or not self.roles.isdisjoint(roles)

    def require(self, *roles: str) -> None:
        if not self.may(*roles):
            held = ", ".join(sorted(self.roles)) or "none"
            raise Forbidden(f"roles [{held}] may not do this (needs {' or '.join(roles)})")

    def require_instance(self, instance_id: str | None) -> None:
        """Emit tokens act only for their own instances (admin for any)."""
        self.require("emit")
        if self.is_admin or self.instance_ids is None:
            return
        if instance_id is None or instance_id not in self.instance_ids:
            raise Forbidden(f"this token may not act for instance {instance_id!r}")

    def require_salts(self, salts: Iterable[str], role: str = "lookup") -> None:
        """``role`` may be used for every salt in ``salts`` (each a tenant's namespace)."""
        self.require(role)
        foreign = self.foreign_salts(salts)
        if foreign:
            verb = _SALT_VERBS.get(role, "use")
            raise Forbidden(f"this token may not {verb} cache_salt {sorted(foreign)[0]!r}")

    def foreign_salts(self, salts: Iterable[str]) -> set[str]:
        """The salts of ``salts`` outside this token's binding (empty for admin/unbound)."""
        if self.is_admin or self.cache_salts is None:
            return set()
        return set(salts) - self.cache_salts

    @property
    def sees_everything(self) -> bool:
        """Global figures (every tenant's) are for admin and salt-unbound tokens only."""
        return self.is_admin or self.cache_salts is None


ANONYMOUS_ADMIN = Principal("anonymous", frozenset({"admin"}))

STREAM_KEY_ID_CONTEXT = "kvatlas stream entry key id v1"
STREAM_MAC_KEY_CONTEXT = "kvatlas stream entry MAC key v1"


@dataclass(frozen=True)
class StreamKey:
    """What the holder of a token signs stream entries with: ``key_id`` (16 hex digits, sent
    with each entry so the coordinator finds the key) and ``secret`` (32 bytes, never sent).
    Both are BLAKE3 key derivations of the token under their own contexts: neither reveals
    the token or the other (docs/security.md, "Redis transport")."""

    key_id: bytes
    secret: bytes = field(repr=False)


def stream_key(token: str) -> StreamKey:
    raw = token.encode("utf-8")
    key_id = blake3.blake3(raw, derive_key_context=STREAM_KEY_ID_CONTEXT).digest()[:8]
    secret = blake3.blake3(raw, derive_key_context=STREAM_MAC_KEY_CONTEXT).digest()
    return StreamKey(key_id.hex().encode(), secret)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def authorization_of(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """A request's ``Authorization`` header (ASGI's lower-case names). Two are refused (401):
    which credential the caller meant would be a guess, and a proxy in front may have read the
    other one."""
    found = [value for name, value in headers if name == b"authorization"]
    if len(found) > 1:
        raise Unauthorized(f"{len(found)} Authorization headers: send one")
    return found[0].decode("latin-1") if found else None


def parse_bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header (401 otherwise)."""
    if not authorization:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("expected Authorization: Bearer <token>")
    return token.strip()


def _string_list(entry: Mapping[str, Any], field: str, where: str) -> frozenset[str] | None:
    value = entry.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}.{field} must be a list of strings")
    return frozenset(value)


ENTRY_FIELDS = ("token", "role", "roles", "name", "instance_ids", "cache_salts")
"""The fields of a token-file entry; any other is refused (a misspelt binding, ``cache_salt``,
would leave the token bound to nothing: every salt, every instance)."""


def principal_from_entry(entry: Any, where: str, name: str) -> tuple[str, Principal]:
    """One token-file entry → ``(token, principal)`` (named ``name`` unless the entry names
    itself); ``ValueError`` naming ``where`` (and the field: an unknown one is refused)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(str(k) for k in entry if k not in ENTRY_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: unknown field {unknown[0]!r} (an entry has {', '.join(ENTRY_FIELDS)})"
        )
    token = entry.get("token")
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}.token must be a string of >= {MIN_TOKEN_CHARS} characters")
    single, several = entry.get("role"), entry.get("roles")
    if several is None:
        several = [single] if single is not None else None
    elif single is not None:
        raise ValueError(f"{where}: give 'role' or 'roles', not both")
    if (
        not isinstance(several, list)
        or not several
        or not all(isinstance(r, str) and r in ROLES for r in several)
    ):
        raise ValueError(f"{where}.roles must be a non-empty list of {', '.join(ROLES)}")
    principal = Principal(
        name=str(entry.get("name") or name),
        roles=frozenset(several),
        instance_ids=_string_list(entry, "instance_ids", where),
        cache_salts=_string_list(entry, "cache_salts", where),
    )
    return token, principal


class TokenAuth:
    """The principals of one token file, looked up by the digest of a bearer token."""

    def __init__(
        self,
        principals: dict[bytes, Principal],
        stream_keys: Mapping[bytes, tuple[StreamKey, Principal]] | None = None,
    ) -> None:
        self._principals = principals
        self._stream_keys = dict(stream_keys or {})

    @classmethod
    def from_tokens(cls, entries: Iterable[tuple[str, Principal]]) -> TokenAuth:
        pairs = list(entries)
        keys: dict[bytes, tuple[StreamKey, Principal]] = {}
        for token, who in pairs:
            key = stream_key(token)
            if key.key_id in keys and keys[key.key_id][0] != key:  # 2^-64: never, but say so
                raise ValueError(f"two tokens share stream key id {key.key_id.decode()}")
            keys[key.key_id] = (key, who)
        return cls({token_digest(token): who for token, who in pairs}, keys)

    @classmethod
    def from_file(cls, path: Path) -> TokenAuth:
        """The tokens of ``path`` (``--auth-token-file``), refused when the file is not
        private to its owner (:func:`check_private`) or a token is too short."""
        check_private(path, "--auth-token-file")
        try:
            doc: Any = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read auth token file {path}: {exc}") from None
        entries = doc.get("tokens") if isinstance(doc, dict) else doc
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{path}: expected {{'tokens': [...]}} with at least one token")
        pairs = [
            principal_from_entry(entry, f"{path}: tokens[{i}]", f"token-{i}")
            for i, entry in enumerate(entries)
        ]
        first: dict[bytes, int] = {}
        for i, (token, _) in enumerate(pairs):
            j = first.setdefault(token_digest(token), i)
            if j != i:  # which entry's roles and bindings it has would be the file's order
                raise ValueError(
                    f"{path}: tokens[{i}] repeats the token of tokens[{j}]: give each token one "
                    "entry (with every role and binding it has)"
                )
        return cls.from_tokens(pairs)

    def bound_salts(self) -> frozenset[str]:
        """Every cache salt some token is bound to: the tenants' (what must stay theirs)."""
        return frozenset(s for who in self._principals.values() for s in who.cache_salts or ())

    def authenticate(self, authorization: str | None) -> Principal:
        principal = self._principals.get(token_digest(parse_bearer(authorization)))
        if principal is None:
            raise Unauthorized("unknown bearer token")
        return principal

    def stream_signer(self, key_id: bytes) -> tuple[StreamKey, Principal] | None:
        """The stream key with id ``key_id`` and the principal of its token (``None``: no
        token of this file derives it)."""
        return self._stream_keys.get(key_id)
