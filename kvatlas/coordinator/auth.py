"""Bearer-token auth: roles ``emit`` (bound to instance ids), ``lookup`` (optionally bound to
cache salts) and ``admin``.

Token file (JSON)::

    {"tokens": [
        {"token": "s3cret", "role": "emit", "instance_ids": ["node-a"]},
        {"token": "t3nant", "role": "lookup", "cache_salts": ["tenant-a"]},
        {"token": "r00t", "role": "admin"}
    ]}

A lookup token without ``cache_salts`` may query every namespace; with them, a tenant cannot
reach another tenant's KV even by guessing its salt. Tokens are compared by SHA-256 digest
(dictionary lookup on a digest leaks nothing useful about the token through timing).

Failures are :class:`kvatlas.errors.Unauthorized` (401: no or unknown token) and
:class:`kvatlas.errors.Forbidden` (403: a known token outside its role, instances or salts).
See docs/coordinator.md ("Security").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvatlas.errors import Forbidden, Unauthorized

ROLES = ("emit", "lookup", "admin")


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    instance_ids: frozenset[str] | None = None  # emit: None = any
    cache_salts: frozenset[str] | None = None  # lookup: None = any

    def require(self, *roles: str) -> None:
        if self.role != "admin" and self.role not in roles:
            raise Forbidden(f"role {self.role!r} may not do this (needs {' or '.join(roles)})")

    def require_instance(self, instance_id: str | None) -> None:
        """Emit tokens act only for their own instances (admin for any)."""
        self.require("emit")
        if self.role == "admin" or self.instance_ids is None:
            return
        if instance_id is None or instance_id not in self.instance_ids:
            raise Forbidden(f"this token may not act for instance {instance_id!r}")

    def require_salts(self, salts: Iterable[str]) -> None:
        self.require("lookup")
        if self.role == "admin" or self.cache_salts is None:
            return
        foreign = set(salts) - self.cache_salts
        if foreign:
            raise Forbidden(f"this token may not query cache_salt {sorted(foreign)[0]!r}")


ANONYMOUS_ADMIN = Principal("anonymous", "admin")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenAuth:
    def __init__(self, principals: dict[bytes, Principal]) -> None:
        self._principals = principals

    @classmethod
    def from_file(cls, path: Path) -> TokenAuth:
        try:
            doc: Any = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read auth token file {path}: {exc}") from None
        entries = doc.get("tokens") if isinstance(doc, dict) else doc
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{path}: expected {{'tokens': [...]}} with at least one token")
        principals: dict[bytes, Principal] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: tokens[{i}] must be an object")
            token, role = entry.get("token"), entry.get("role")
            if not isinstance(token, str) or len(token) < 8:
                raise ValueError(f"{path}: tokens[{i}].token must be a string of >= 8 characters")
            if role not in ROLES:
                raise ValueError(f"{path}: tokens[{i}].role must be one of {', '.join(ROLES)}")
            ids, salts = entry.get("instance_ids"), entry.get("cache_salts")
            for field, value in (("instance_ids", ids), ("cache_salts", salts)):
                if value is not None and (
                    not isinstance(value, list) or not all(isinstance(v, str) for v in value)
                ):
                    raise ValueError(f"{path}: tokens[{i}].{field} must be a list of strings")
            principals[_digest(token)] = Principal(
                name=str(entry.get("name") or f"token-{i}"),
                role=role,
                instance_ids=frozenset(ids) if ids is not None else None,
                cache_salts=frozenset(salts) if salts is not None else None,
            )
        return cls(principals)

    def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("expected Authorization: Bearer <token>")
        principal = self._principals.get(_digest(token.strip()))
        if principal is None:
            raise Unauthorized("unknown bearer token")
        return principal
