"""The compiled JSON token-list parser agrees with a strict Python reference on every input."""

from __future__ import annotations

import functools
import json
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.events._json_tokens import parse_token_lists, string_end


def reference(raw: bytes) -> list[int] | None:
    """Valid iff JSON decodes to a list of plain non-negative ints < 2**32 written canonically,
    or to ``null`` (no tokens: an empty list)."""
    try:
        values = json.loads(raw)
    except ValueError:
        return None
    if values is None:
        return []
    if not isinstance(values, list):
        return None
    if not all(type(v) is int and 0 <= v < 1 << 32 for v in values):
        return None
    text = raw.decode()
    if any(c in text for c in ".eE+-"):  # json.loads accepts "1e3"/"-0" forms as ints? keep strict
        return None
    return values


def check(raws: list[bytes]) -> None:
    arena, lengths, bad = parse_token_lists(raws)
    expected = [reference(r) for r in raws]
    first_bad = next((j for j, e in enumerate(expected) if e is None), -1)
    assert bad == first_bad
    if bad == -1:
        start = 0
        for values, n in zip(expected, lengths.tolist(), strict=True):
            assert values is not None
            assert arena[start : start + n].tolist() == values
            start += n


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, (1 << 32) - 1), max_size=40), max_size=8),
    st.sampled_from(["", " ", "\n "]),
)
def test_valid_lists_round_trip(lists: list[list[int]], space: str) -> None:
    raws = [
        (space + "[" + ("," + space).join(map(str, values)) + space + "]" + space).encode()
        for values in lists
    ]
    check(raws)


@pytest.mark.parametrize(
    "raw",
    [b"[1.5]", b"[1e3]", b"[-1]", b"[01]", b"[4294967296]", b"[99999999999]", b"[1,]", b"[,1]",
     b"[1 2]", b"[[1]]", b'["1"]', b"[true]", b"[1]x", b"{}", b"1", b"[", b"]", b"", b"[1,2", b"[+1]",
     b"[18446744073709551617]"],
)  # fmt: skip
def test_invalid_lists_rejected(raw: bytes) -> None:
    bad = parse_token_lists([b"[1,2]", raw])[2]
    assert bad == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=30))
def test_arbitrary_bytes_agree_with_reference(raw: bytes) -> None:
    check([raw])


def test_boundaries_and_empty() -> None:
    arena, lengths, bad = parse_token_lists([b"[]", b"[0, 4294967295]", b" [ ] "])
    assert bad == -1 and lengths.tolist() == [0, 2, 0]
    assert arena[:2].tolist() == [0, 4294967295]
    assert parse_token_lists([])[2] == -1
    assert np.asarray(parse_token_lists([b"[7]"])[0]).dtype == np.uint32


@pytest.mark.parametrize("raw", [b"[]\x00", b"[] x", b"[]]", b"[],", b"[ ] 1"])
def test_nothing_but_white_space_after_an_empty_list(raw: bytes) -> None:
    """Found by the property test above: the empty-list branch skipped the trailing check."""
    check([raw])
    assert parse_token_lists([raw])[2] == 0
    assert parse_token_lists([b"[1]", raw])[2] == 1


@pytest.mark.parametrize(("raw", "bad"), [(b" null ", -1), (b"\nnull", -1), (b"nul", 0), (b"nullx", 0), (b"null,", 0)])  # fmt: skip
def test_null_reads_as_no_tokens(raw: bytes, bad: int) -> None:
    assert parse_token_lists([raw])[2] == bad


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(0, 9_999_999), st.integers(0, (1 << 32) - 1), st.integers(0, 10**12)),
        min_size=1,
        max_size=30,
    ),
    st.lists(
        st.tuples(st.integers(0, 1 << 16), st.sampled_from(b"0123456789 ,]-+.eE\x80\xff\x00:/\t")),
        max_size=3,
    ),
    st.sampled_from(["", " "]),
)
def test_word_at_a_time_numbers_agree_with_reference(
    values: list[int], edits: list[tuple[int, int]], space: str
) -> None:
    """Lists long enough for the eight-bytes-at-a-time path (``_short_number``: 1-7 digits
    and the byte after them read from one word), with numbers of every length up to 13
    digits and a few bytes overwritten (leading zeros, signs, fractions, exponents, white
    space, bytes above 0x7f, the characters either side of the digits): the same ids and
    the same verdict as the strict reference."""
    raw = bytearray(("[" + ("," + space).join(map(str, values)) + "]").encode())
    for at, byte in edits:
        raw[at % len(raw)] = byte
    check([bytes(raw), b"[1,2,3,4,5,6,7,8]"])
    check([bytes(raw) + b"      "])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40).map(lambda b: b.replace(b'"', b"a").replace(b"\\", b"b")),
       st.binary(max_size=6), st.integers(0, 48))  # fmt: skip
def test_string_end_finds_the_first_quote_or_backslash(
    plain: bytes, tail: bytes, bound: int
) -> None:
    """The word-at-a-time string scan of the token cut: the first ``"`` or ``\\`` at or after
    the start, never one at or past the bound, whatever bytes precede it."""
    buf = np.frombuffer(plain + tail, np.uint8)
    n = min(bound, len(buf))
    for start in range(n + 1):
        found = [i for i in range(start, n) if buf[i] in b'"\\']
        assert string_end(buf, start, n) == (found[0] if found else n)


def _listed(tokens: np.ndarray | None) -> list[int] | None:
    return None if tokens is None else tokens.tolist()


def _body_with_tokens(text: bytes) -> bytes:
    """A one-entry store body whose ``token_ids`` is ``text`` as written, the list the body's
    last value (its numbers end a few bytes before the end of the buffer)."""
    import msgspec

    from kvatlas.events import CacheEntry, EventBatch, encode_json
    from kvatlas.keys import ObjectKey, pack_kv_rank

    entry = CacheEntry(
        ObjectKey(bytes(32), "m", pack_kv_rank(1, 0, 1, 0)), 1, np.arange(4, dtype=np.uint32), 0
    )
    body = encode_json([EventBatch("a", 1, 1, "store", "l1", "dram", entries=(entry,))])
    wire = msgspec.json.decode(body)
    wire["batches"][0]["entries"][0].pop("token_ids")
    out = msgspec.json.encode(wire)
    assert out.endswith(b"}]}]}")
    return out[:-5] + b',"token_ids":' + text + b"}]}]}"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 10**11), min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(0, 200), st.sampled_from(b"0 -+.eE:,]")), max_size=2),
    st.integers(0, 8),
)
def test_whole_body_token_cut_agrees_with_the_per_entry_decoder(
    values: list[int], edits: list[tuple[int, int]], cut: int
) -> None:
    """Bodies decoded by the one-pass cut (``_json_cut``: numbers read eight bytes at a time
    within the whole body) against the per-entry decoder: numbers of every length, a few bytes
    overwritten, and bodies cut short by up to 8 bytes (a number at the very end of the
    buffer): the same tokens or the same error."""
    from kvatlas.errors import KvatlasError
    from kvatlas.events import decode_json, decode_json_columns

    text = bytearray(("[" + ",".join(map(str, values)) + "]").encode())
    for at, byte in edits:
        text[at % len(text)] = byte
    body = _body_with_tokens(bytes(text))
    body = body[: len(body) - cut]
    outcomes = []
    for decode in (decode_json, decode_json_columns):
        try:
            batches = decode(body)
        except KvatlasError as exc:
            outcomes.append((type(exc), exc.detail))
            continue
        if decode is decode_json_columns:
            batches = [cb.batch() for cb in batches]
        outcomes.append([[_listed(e.token_ids) for e in b.entries] for b in batches])
    assert outcomes[0] == outcomes[1]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(b"0123456789") | st.integers(0, 255), min_size=8, max_size=8))
def test_short_number_of_any_word_against_the_bytes(word: list[int]) -> None:
    """``_short_number`` (the bit trick behind the word-at-a-time numbers) on any eight bytes,
    digits or not (bytes above 0x7f, either side of the digits): 1-7 leading digits without a
    leading zero give their count and value, anything else 0 (read byte by byte)."""
    from kvatlas.events._json_tokens import _short_number

    raw = bytes(word)
    digits = next((i for i, c in enumerate(raw) if not 48 <= c <= 57), 8)
    expected = (0, 0)
    if 1 <= digits <= 7 and not (digits > 1 and raw[0] == 48):
        expected = (digits, int(raw[:digits]))
    got = _short_number(np.uint64(int.from_bytes(raw, "little")))
    assert (int(got[0]), int(got[1])) == expected


@functools.cache
def _into(values4: Any) -> Any:
    @numba.njit
    def call(arena: Any, w: Any, s: Any) -> None:  # (arena[0] untouched)
        values4(arena, 1, w[0], w[1], w[2], w[3], s[0], s[1], s[2], s[3])

    return call


_NUMBER = st.tuples(st.integers(1, 8), st.binary(min_size=8, max_size=8))


@settings(max_examples=300, deadline=None)
@given(st.lists(_NUMBER, min_size=4, max_size=4))
def test_four_numbers_at_once_read_as_one_at_a_time(numbers: list[tuple[int, bytes]]) -> None:
    """``values4`` (the vector lanes, and the word-by-word form of big-endian machines) on
    four words of 1-8 digits each, whatever bytes follow them in the word: each number's
    value, as ``int`` reads its digits."""
    from kvatlas.events import _json_words

    words, shifts, expected = [], [], []
    for digits, rest in numbers:
        text = bytes(48 + b % 10 for b in rest[:digits]) + rest[digits:]
        words.append(np.uint64(int.from_bytes(text, "little")))
        shifts.append(np.uint64(64 - 8 * digits))
        expected.append(int(text[:digits]))
    for form in (_json_words._vector_values4, _json_words._word_values4):
        arena = np.full(6, 7, np.uint32)
        _into(form)(arena, tuple(words), tuple(shifts))
        assert arena.tolist() == [7, *expected, 7]


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=64, max_size=64), st.lists(st.sampled_from(b"0123456789,"), max_size=64))
def test_masks_mark_exactly_the_digit_comma_and_zero_bytes(raw: bytes, marks: list[int]) -> None:
    """``masks`` (the block-at-a-time numbers' masks) on any 64 bytes, digits and commas
    mixed in anywhere: bit ``t`` of each set iff byte ``t`` is '0'-'9', ',', '0', whatever
    the bytes beside it (a borrow or carry crossing a byte would mark a neighbour)."""
    from kvatlas.events._json_words import swar_masks

    block = bytearray(raw)
    for t, d in enumerate(marks):
        block[(t * 7) % 64] = d
    want = tuple(
        sum(1 << t for t, c in enumerate(block) if test(c))
        for test in (lambda c: 48 <= c <= 57, lambda c: c == 44, lambda c: c == 48)
    )
    buf = np.frombuffer(bytes(block), np.uint8)
    assert tuple(map(int, _machines_masks()(buf))) == want  # vector compares on this machine
    assert tuple(map(int, swar_masks(buf, 0))) == want  # word by word, a big-endian machine's


@functools.cache
def _machines_masks() -> Any:
    """``masks`` of an array's first 64 bytes, callable from Python (an intrinsic is
    callable from compiled code only)."""
    from kvatlas.events._json_words import masks

    return numba.njit(lambda buf: masks(buf, 0))


@pytest.mark.parametrize("lead", [b"0", b"012", b"00", b"0123456"])
def test_a_leading_zero_anywhere_in_a_compact_list_reads_as_the_reference(lead: bytes) -> None:
    """Blocks of digits and commas only are checked once for all their numbers: a number
    with a leading zero at every offset of a long compact list (starting in one block and
    going on in the next, carried from a block read number by number, at a block's last
    byte) is refused, a lone 0 taken, as the reference does."""
    values = [str(v).encode() for v in range(100_000, 100_000 + 400 * 7919, 7919)]
    for at in range(1, 130):
        body = b",".join(values)
        body = body[:at] + b"," + lead + b"," + body[at:]
        body = body.replace(b",,", b",1,")
        for text in (b"[" + body + b"]", b"[" + body.replace(b",", b", ", 3) + b"]"):
            check([text])


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(0, 128_255), st.integers(0, 99_999_999), st.integers(0, 10**11)),
        min_size=20,
        max_size=300,
    ),
    st.lists(
        st.tuples(st.integers(0, 1 << 16), st.sampled_from(b"0123456789 ,]-+.eE\x80\xff\x00:/\t[")),
        max_size=3,
    ),
    st.sampled_from(["", " ", "  "]),
    st.integers(0, 80),
)
def test_block_at_a_time_numbers_agree_with_reference(
    values: list[int], edits: list[tuple[int, int]], space: str, pad: int
) -> None:
    """Lists long enough for the block-at-a-time path (``_usual_numbers``: 1-8 digits
    between the non-digits of a 64-byte mask), numbers of up to 12 digits, separators with
    no, one or two spaces, a few bytes overwritten anywhere and white space after the list
    (so that its end falls anywhere in a block): the same ids and verdict as the reference,
    whether the list is parsed alone or after another."""
    raw = bytearray(("[" + ("," + space).join(map(str, values)) + "]").encode())
    for at, byte in edits:
        raw[at % len(raw)] = byte
    text = bytes(raw) + b" " * pad
    check([text])
    check([b"[1,2,3]", text, b"[4]"])
