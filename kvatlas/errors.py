"""One error tree for all of kvatlas; every error a caller can act on is a ``KvatlasError``.

    KvatlasError
    ├── InvalidInput                 the caller sent something wrong (400; also a ValueError)
    │   ├── Unprocessable            well-formed but breaks a field rule (422)
    │   │   └── EventValidationError (kvatlas.events) ── EventDecodeError
    │   ├── PayloadTooLarge          over a configured limit (413)
    │   ├── ChunkDecodeError         (kvatlas.node) a stored/fetched chunk is torn or foreign
    │   ├── SnapshotError            (kvatlas.directory) a snapshot file is unusable
    │   └── PermanentSendError       (kvatlas.client) the receiver refused a batch: quarantine it
    │       ├── SendTooLargeError    (kvatlas.client) 413: halve the send
    │       └── SaltRefusedError     (kvatlas.client) 403 naming entries' salts: send without them
    │                                (also still a RuntimeError)
    ├── Unauthorized                 no or unknown credentials (401)
    ├── Forbidden                    credentials that may not do this (403)
    ├── NotFound                     the named thing does not exist (here) (404)
    ├── Conflict                     contradicts state already held (409; also a RuntimeError)
    │   └── KeySchemeMismatch        (kvatlas.keys) two parts would compute different keys
    └── Unavailable                  a dependency is down or overloaded; retrying may help
        │                            (503; also a RuntimeError)
        ├── BadGateway               a server this one forwards to did not answer (502)
        ├── L2Unavailable            (kvatlas.node)
        ├── TransientSendError       (kvatlas.client) worth retrying the delivery
        │   └── AuthSendError        (kvatlas.client) 401/403 for the sender: retried, counted
        ├── CoordinatorError         (kvatlas.client) no answer, or a refusal, from the
        │                            coordinator (``reply_status`` says which)
        └── EngineCallError          (kvatlas.node) the same for a node's engine API

Each class carries the HTTP status it maps to (``status``) and keyword ``extra`` fields that a
reply adds beside ``detail``; :mod:`kvatlas.web` turns any ``KvatlasError`` into a reply, for
the coordinator and the node alike. Programming errors (``TypeError`` on a wrong Python type)
stay built-in exceptions.
"""

from __future__ import annotations

from typing import Any, ClassVar


class KvatlasError(Exception):
    """Root of the tree. ``detail`` is the human-readable message; ``extra`` goes on the wire."""

    status: ClassVar[int] = 500

    def __init__(self, detail: str = "", **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class InvalidInput(KvatlasError, ValueError):
    status = 400


class Unprocessable(InvalidInput):
    status = 422


class PayloadTooLarge(InvalidInput):
    status = 413


class Unauthorized(KvatlasError):
    status = 401


class Forbidden(KvatlasError):
    status = 403


class NotFound(KvatlasError):
    status = 404


class Conflict(KvatlasError, RuntimeError):
    status = 409


class Unavailable(KvatlasError, RuntimeError):
    status = 503


class BadGateway(Unavailable):
    status = 502


__all__ = [
    "BadGateway",
    "Conflict",
    "Forbidden",
    "InvalidInput",
    "KvatlasError",
    "NotFound",
    "PayloadTooLarge",
    "Unauthorized",
    "Unavailable",
    "Unprocessable",
]
