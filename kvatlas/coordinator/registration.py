"""Registration: what an instance may say about itself, each field within its limit and form
(a peer URL is where other nodes send requests: it must not smuggle credentials or point into
another service's API). Errors come from :mod:`kvatlas.errors` (422, 413 for metadata)."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import msgspec

from kvatlas.api import RegisterRequest
from kvatlas.coordinator.instances import Registration
from kvatlas.errors import PayloadTooLarge, Unprocessable
from kvatlas.keys import check_instance_id

MAX_ADDRESS_CHARS = 256  # ip, p2p_advertised_url
MAX_METADATA_BYTES = 16 * 1024  # registration metadata, as JSON
MAX_SIGNATURE_CHARS = 128  # p2p_url_signature: hex (a node's is 64)
_HEX = re.compile(r"[0-9A-Fa-f]*")
_HOST_NAME = r"[A-Za-z0-9._-]+"  # a host name or an IPv4 address, as a URL's host
_HOST_PORT = re.compile(rf"(?:{_HOST_NAME}|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{{1,5}}))?")


def registration(body: RegisterRequest) -> tuple[str | None, Registration]:
    """The instance id asked for (``None`` or ``""``: the coordinator assigns one) and what
    the instance says about itself (LMCache's defaults ``""`` and ``0`` are absent), each field
    within its size limit (``metadata`` 413, the rest 422)."""
    if body.instance_id:
        try:
            check_instance_id(body.instance_id)
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
    if len(body.ip) > MAX_ADDRESS_CHARS:
        raise Unprocessable(f"ip must be at most {MAX_ADDRESS_CHARS} characters")
    if body.ip and not _host(body.ip):
        raise Unprocessable(
            f"ip must be an IP address or a host name, without a port: got {body.ip!r:.80}"
        )
    for name, port in (("http_port", body.http_port), ("mq_port", body.mq_port)):
        if port is not None and not 0 <= port <= 65535:
            raise Unprocessable(f"{name} must be in [0, 65535] (0: none), got {port}")
    if body.chunk_size is not None and body.chunk_size < 1:
        raise Unprocessable(f"chunk_size must be >= 1, got {body.chunk_size}")
    metadata: dict[str, Any] = body.metadata
    size = len(msgspec.json.encode(metadata))
    if size > MAX_METADATA_BYTES:
        raise PayloadTooLarge(f"metadata of {size} bytes (JSON) exceeds {MAX_METADATA_BYTES}")
    url = peer_url(body.p2p_advertised_url) or None
    return body.instance_id or None, Registration(
        body.ip,
        body.http_port,
        metadata,
        url,
        body.mq_port or None,
        url_signature(body.p2p_url_signature) if url else None,
        engine_id(body.engine_id, body.instance_id),
    )


def _host(ip: str) -> bool:
    """An IP address (v4 or v6, unbracketed) or a host name: what ``http://{ip}:{http_port}``
    (IPv6 in brackets) makes a URL of."""
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        return re.fullmatch(_HOST_NAME, ip) is not None
    return True


def engine_id(engine: str | None, instance_id: str | None) -> str | None:
    """``engine_id``: an instance id other than the node's own (422), or absent (``""`` too).
    An engine no KV events named yet is fine: engines and nodes start in any order."""
    if not engine:
        return None
    try:
        check_instance_id(engine)
    except ValueError as exc:
        raise Unprocessable(f"engine_id: {exc}") from None
    if engine == instance_id:
        raise Unprocessable("engine_id must name an engine, not the node itself")
    return engine


def url_signature(signature: str | None) -> str | None:
    """``p2p_url_signature``: hex of at most ``MAX_SIGNATURE_CHARS`` (else 422), or absent.
    The coordinator keeps and lists it; the nodes verify it (docs/security.md)."""
    if not signature:
        return None
    if len(signature) > MAX_SIGNATURE_CHARS or not _HEX.fullmatch(signature):
        raise Unprocessable(
            f"p2p_url_signature must be hex of at most {MAX_SIGNATURE_CHARS} characters"
        )
    return signature


def peer_url(url: str | None) -> str | None:
    """``p2p_advertised_url`` as other nodes will fetch KV from it: ``http(s)://host[:port]``,
    or LMCache's ``host:port``, or empty. Anything else (another scheme, userinfo, a path,
    query or fragment) is refused with 422: a URL is where peers send requests, so it must not
    smuggle credentials or point into another service's API."""
    if not url:
        return url
    if len(url) > MAX_ADDRESS_CHARS:
        raise Unprocessable(f"p2p_advertised_url must be at most {MAX_ADDRESS_CHARS} characters")
    scheme, has_scheme, rest = url.partition("://")
    if not has_scheme:
        scheme, rest = "", url
    elif scheme.lower() not in ("http", "https"):
        raise Unprocessable(f"p2p_advertised_url: scheme must be http or https, not {scheme!r}")
    if "@" in rest:
        raise Unprocessable("p2p_advertised_url must not carry userinfo (user:password@)")
    match = _HOST_PORT.fullmatch(rest.removesuffix("/"))
    if match is None:
        raise Unprocessable(
            "p2p_advertised_url must be http(s)://host[:port] (no path, query or fragment)"
        )
    port = match.group("port")
    if port is not None and not 0 < int(port) <= 65535:
        raise Unprocessable("p2p_advertised_url: port must be in 1..65535")
    return url
