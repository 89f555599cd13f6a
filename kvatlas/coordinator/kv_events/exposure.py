"""What the outward KV-event stream may show, and to whom (docs/security.md, "KV events").

The stream carries chunk hashes and, when a batch had them, prompt token ids: it is as
sensitive as the prompts. So it carries only the cache salts the operator chose (default: the
unsalted one, unless a token is bound to it: never a bound tenant's), its sockets (PUB and
replay ROUTER) are CurveZMQ servers when a certificate is configured, and with auth on a socket
reachable from beyond this host is refused at start-up unless it is authenticated or the
operator says ``--kv-events-publish-unauthenticated``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvatlas.web import is_loopback


def is_local(endpoint: str) -> bool:
    """Whether a ZMQ endpoint is reachable only from this host (loopback TCP, ipc, inproc)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    return is_loopback(urlsplit(endpoint).hostname or "")


@dataclass(frozen=True, slots=True)
class StreamExposure:
    salts: frozenset[str] = frozenset({""})  # the cache salts whose placements are published
    server_certificate: Path | None = None  # zmq.auth secret certificate: CurveZMQ server
    client_keys: Path | None = None  # directory of the routers' public certificates

    @classmethod
    def choose(
        cls,
        salts: Iterable[str] | None,
        bound: frozenset[str],
        server_certificate: Path | None,
        client_keys: Path | None,
    ) -> StreamExposure:
        """``salts`` as the operator listed them, else the unsalted one unless it is bound."""
        chosen = frozenset(salts) if salts is not None else frozenset({""}) - bound
        if (server_certificate is None) != (client_keys is None):
            raise ValueError(
                "--kv-events-curve-certificate and --kv-events-curve-clients go together"
            )
        return cls(chosen, server_certificate, client_keys)

    @property
    def authenticated(self) -> bool:
        return self.server_certificate is not None

    def check_endpoints(self, endpoints: Iterable[str], auth_on: bool, allow_open: bool) -> None:
        """With auth on, a socket beyond this host must be authenticated (or allowed open)."""
        if not auth_on or self.authenticated or allow_open:
            return
        exposed = [e for e in endpoints if not is_local(e)]
        if exposed:
            raise ValueError(
                f"{', '.join(exposed)}: the KV-event stream carries prompts' token ids and chunk "
                "hashes; with auth on it binds beyond loopback only with CurveZMQ "
                "(--kv-events-curve-certificate, --kv-events-curve-clients) or "
                "--kv-events-publish-unauthenticated (docs/security.md)"
            )

    def start(self, ctx: Any) -> Any:
        """Start the ZAP authenticator on ``ctx`` (``None`` when not authenticated)."""
        if self.client_keys is None:
            return None
        from zmq.auth.thread import ThreadAuthenticator

        authenticator = ThreadAuthenticator(ctx)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(self.client_keys))
        return authenticator

    def secure(self, sock: Any) -> None:
        """Make ``sock`` a CurveZMQ server (before it binds), when configured."""
        if self.server_certificate is None:
            return
        import zmq.auth

        public, secret = zmq.auth.load_certificate(self.server_certificate)
        if secret is None:
            raise ValueError(f"{self.server_certificate}: not a secret certificate")
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
