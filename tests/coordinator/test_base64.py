"""The base64 decoder of query tokens accepts exactly the strict, padded standard alphabet (and
the two unambiguous liberal forms), through libbase64's SIMD code on this machine."""

from __future__ import annotations

import base64
import binascii

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator._base64 import b64decode_strict, decode_base64

ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_"


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


def _reference(text: bytes) -> bytes | None:
    """The accepted language spelled out: whitespace ignored, both alphabets, length a multiple
    of 4, ``=`` only as the last one or two characters (``xx==``, ``xxx=``)."""
    text = bytes(c for c in text if c not in b" \t\r\n")
    body = text.rstrip(b"=")
    if len(text) % 4 or len(text) - len(body) > 2 or b"=" in body:
        return None
    if len(text) - len(body) == 2 and len(body) % 4 != 2:
        return None
    std = body.replace(b"-", b"+").replace(b"_", b"/")
    if any(
        c not in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/" for c in std
    ):
        return None
    return base64.b64decode(std + b"=" * (-len(std) % 4))


_SPECIAL = '=-_ \n!é"\\A/+'


@settings(max_examples=1000, deadline=None)
@given(
    st.binary(max_size=120),
    st.lists(st.tuples(st.integers(0, 200), st.sampled_from(_SPECIAL)), max_size=3),
    st.booleans(),
)
def test_accepts_exactly_the_documented_language(
    data: bytes, edits: list[tuple[int, str]], urlsafe: bool
) -> None:
    """Long texts (the main loop and the last quartet) with a few characters changed."""
    text = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(data).decode()
    for position, char in edits:
        k = position % (len(text) + 1)
        text = text[:k] + char + text[k + 1 :]
    raw = text.encode("ascii", "replace")
    expected = _reference(raw)
    ours = b64decode_strict(text)
    assert (None if ours is None else ours.tobytes()) == expected, text


def test_the_hot_path_takes_no_whitespace() -> None:
    """``decode_base64`` is the strict core the blend lookup's hot path reads the body with (a
    slice of the body, uncopied): whitespace is for :func:`b64decode_strict` to strip. What it
    returns is a writable array of its own, as every other query's tokens are (the compiled
    match takes one array type)."""
    encoded = base64.b64encode(bytes(range(30)))
    body = b'{"tokens_b64": "' + encoded + b'"}'
    decoded = decode_base64(memoryview(body)[16:-2])
    assert decoded is not None and decoded.tobytes() == bytes(range(30))
    assert decoded.flags.writeable and decoded.flags.aligned
    assert decode_base64(np.frombuffer(encoded[:8] + b" " + encoded[9:], dtype=np.uint8)) is None
    assert decode_base64(np.frombuffer(b"", dtype=np.uint8)) is not None


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 3), st.data())
def test_any_bad_character_anywhere_at_any_alignment(
    data: bytes, shift: int, draw: st.DataObject
) -> None:
    """A character outside the alphabet is refused wherever it is (a whole block, the rest, the
    last quartet) and wherever the text starts in its buffer."""
    text = base64.b64encode(data)
    src = np.frombuffer(b"=" * shift + text, dtype=np.uint8)[shift:]
    decoded = decode_base64(src)
    assert decoded is not None and decoded.tobytes() == data
    at = draw.draw(st.integers(0, len(text) - 1))
    bad = draw.draw(st.sampled_from(b"!*.:@[`{\x00\x80\xff"))
    broken = bytearray(text)
    broken[at] = bad
    src = np.frombuffer(b"=" * shift + bytes(broken), dtype=np.uint8)[shift:]
    assert decode_base64(src) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=96, max_size=700), st.data())
def test_blocks_take_every_byte_value_anywhere(data: bytes, draw: st.DataObject) -> None:
    """Texts of several vector blocks and a rest: any byte value at
    any position is accepted exactly when the alphabet holds it (then it decodes as the
    reference does), in either alphabet, wherever the text starts in its buffer."""
    urlsafe = draw.draw(st.booleans())
    text = bytearray((base64.urlsafe_b64encode if urlsafe else base64.b64encode)(data))
    at = draw.draw(st.integers(0, len(text) - 1))
    text[at] = draw.draw(st.integers(0, 255))
    shift = draw.draw(st.integers(0, 7))
    src = np.frombuffer(b"A" * shift + bytes(text), dtype=np.uint8)[shift:]
    ours = decode_base64(src)
    assert (None if ours is None else ours.tobytes()) == _reference(bytes(text))


def test_block_path_is_taken_and_refuses_per_character() -> None:
    """Negative control: a 32k-token text (the lookups' size) decodes, and each character
    outside the alphabet, in the first, a middle and the last whole block, is refused."""
    data = np.random.default_rng(3).integers(0, 1 << 32, 32768, dtype=np.uint64)
    text = base64.b64encode(data.astype(np.uint32).tobytes())
    decoded = decode_base64(np.frombuffer(text, dtype=np.uint8))
    assert decoded is not None and decoded.tobytes() == base64.b64decode(text)
    alphabet = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")
    whole = (len(text) - 4) // 64 * 64
    for at in (0, 63, len(text) // 2, whole - 1):
        for byte in set(range(256)) - alphabet:
            broken = bytearray(text)
            broken[at] = byte
            assert decode_base64(np.frombuffer(bytes(broken), dtype=np.uint8)) is None, (at, byte)


def test_the_simd_decoder_is_the_one_in_use() -> None:
    """pybase64 falls back to the standard library's decoder (≈40× slower for a 32k-token
    query) when its C extension did not install: that is a broken install, not a slow path."""
    import pybase64

    assert "C extension active" in pybase64.get_version()
