"""The compiled base64 decoder accepts exactly the strict, padded standard alphabet."""

from __future__ import annotations

import base64
import binascii

from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator._base64 import b64decode_strict


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_round_trip(data: bytes) -> None:
    decoded = b64decode_strict(base64.b64encode(data).decode())
    assert decoded is not None and decoded.tobytes() == data


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="ABCDEFabcdef0123456789+/=!-_ \\n", max_size=24))
def test_never_accepts_what_the_standard_library_rejects(text: str) -> None:
    """Modulo the two liberal extensions (whitespace ignored, URL-safe alphabet)."""
    normalized = "".join(text.split()).replace("-", "+").replace("_", "/")
    try:
        reference: bytes | None = base64.b64decode(normalized, validate=True)
    except (binascii.Error, ValueError):
        reference = None
    ours = b64decode_strict(text)
    if reference is None:
        assert ours is None
    elif ours is not None:
        assert ours.tobytes() == reference
    else:  # stricter only about excess padding after a complete quartet
        assert normalized.rstrip("=") != normalized and len(normalized.rstrip("=")) % 4 == 0


def test_liberal_forms() -> None:
    data = bytes(range(256)) * 3
    wrapped = base64.encodebytes(data).decode()  # newline every 76 characters
    decoded = b64decode_strict(wrapped)
    assert decoded is not None and decoded.tobytes() == data
    urlsafe = b64decode_strict(base64.urlsafe_b64encode(data).decode())
    assert urlsafe is not None and urlsafe.tobytes() == data


def test_rejects() -> None:
    for bad in ["!!!!", "AAA", "AA=A", "A===", "AB==AAAA", "Zg=", "AB=C", "é"]:
        assert b64decode_strict(bad) is None
