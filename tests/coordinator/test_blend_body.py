"""A blend lookup's body decoded on the hot path (``decode_blend_lookup``: ``tokens_b64`` read by
the base64 kernel where it lies, the JSON decoder seeing the rest) gives exactly what the
reference path gives (``decode_blend_body``: the whole body through the typed decoder, then the
string decoded): the same fields and tokens, or the same error (class, status, detail), for
well-formed bodies and for every malformation the split could be fooled by."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.query import blend_query, decode_blend_body, decode_blend_lookup
from kvatlas.errors import KvatlasError

MAX_TOKENS = 8  # small, so the size limits are within reach
ESCAPED_KEY = '"tokens_\\u0062\\u0036\\u0034"'  # "tokens_b64" with escapes: the same field


def _outcome(raw: bytes, hot: bool) -> tuple[Any, ...]:
    try:
        if hot:
            body, decoded = decode_blend_lookup(raw, MAX_TOKENS)
            query = blend_query(body, MAX_TOKENS, decoded)
        else:
            body = decode_blend_body(raw)
            query = blend_query(body, MAX_TOKENS)
    except KvatlasError as exc:
        return ("error", type(exc).__name__, exc.status, exc.detail)
    fields = (body.model_name, body.world_size, body.cache_salt)
    if query is None:
        return ("empty", *fields)
    return ("query", *fields, query.namespace, query.tokens.dtype.str, query.tokens.tobytes())


def assert_same(raw: bytes) -> None:
    assert _outcome(raw, hot=True) == _outcome(raw, hot=False), raw[:200]


def _b64(n_tokens: int) -> str:
    return base64.b64encode(np.arange(1, n_tokens + 1, dtype="<u4").tobytes()).decode()


VALID = _b64(3)
HAND_PICKED = [
    f'{{"tokens_b64": "{VALID}", "model_name": "m"}}',
    f'{{"model_name": "m", "tokens_b64": "{VALID}"}}',
    f'  {{ "tokens_b64" :\n"{VALID}" ,\t"model_name":"m" }}  ',
    f'{{"tokens_b64": "{VALID}"}}',
    f'{{"tokens_b64": "{_b64(MAX_TOKENS)}", "model_name": "m"}}',
    f'{{"tokens_b64": "{_b64(MAX_TOKENS + 1)}", "model_name": "m"}}',  # 413
    f'{{"tokens_b64": "{_b64(MAX_TOKENS * 3)}", "model_name": "m"}}',  # 413 before decoding
    '{"tokens_b64": "", "model_name": "m"}',
    '{"tokens_b64": "AAAAAA==", "model_name": "m"}',  # 4 bytes + 1: not uint32
    '{"tokens_b64": "AQAAAA==", "token_ids": [1], "model_name": "m"}',  # both forms
    '{"token_ids": [1], "tokens_b64": "AQAAAA==", "model_name": "m"}',
    '{"tokens_b64": "AQAAAA==", "token_ids": null, "model_name": "m"}',
    '{"tokens_b64": "AQAAAA=="}',  # model_name missing
    '{"tokens_b64": "AQAAAA==", "model_name": "m", "world_size": 0}',
    '{"tokens_b64": "AQAAAA==", "model_name": "m", "world_size": "2"}',
    '{"tokens_b64": "AQAA AA==", "model_name": "m"}',  # whitespace inside
    '{"tokens_b64": "AQAAAA\\u003d\\u003d", "model_name": "m"}',  # escapes
    '{"tokens_b64": "AQAAAA\\/=", "model_name": "m"}',
    '{"tokens_b64": "AQAAAA!=", "model_name": "m"}',
    '{"tokens_b64": null, "model_name": "m"}',
    '{"tokens_b64": 5, "model_name": "m"}',
    '{"tokens_b64": ["AQAAAA=="], "model_name": "m"}',
    # the same field twice: msgspec keeps the last, the typed decoder refuses an earlier one
    '{"tokens_b64": 5, "tokens_b64": "AQAAAA==", "model_name": "m"}',
    '{"tokens_b64": "AQAAAA==", "tokens_b64": 5, "model_name": "m"}',
    '{"tokens_b64": "AQAAAA==", "model_name": "m", "tokens_b64": null}',
    '{"tokens_b64": "AQAAAA==", "model_name": "m", "tokens_b64": "AgAAAA=="}',
    f'{{{ESCAPED_KEY}: 5, "tokens_b64": "AQAAAA==", "model_name": "m"}}',
    f'{{"tokens_b64": "AQAAAA==", {ESCAPED_KEY}: 5, "model_name": "m"}}',
    # the key somewhere else than as a member of the top-level object
    '{"meta": {"tokens_b64": "AQAAAA=="}, "model_name": "m"}',
    '{"meta": {"x": 1, "tokens_b64": "AQAAAA=="}, "model_name": "m"}',
    '{"model_name": "tokens_b64", "tokens_b64": "AQAAAA=="}',
    '{"model_name": "\\"tokens_b64\\": \\"AQAAAA==\\"", "tokens_b64": "AgAAAA=="}',
    '{"a": "q,"tokens_b64": "AQAAAA==",", "model_name": "m"}',  # a string closed by the tail
    '["tokens_b64", "AQAAAA=="]',
    '"tokens_b64"',
    # malformed around the member
    '{"tokens_b64": "AQAAAA==", }',
    '{, "tokens_b64": "AQAAAA==", "model_name": "m"}',
    '{"model_name": "m",, "tokens_b64": "AQAAAA=="}',
    '{"tokens_b64" "AQAAAA==", "model_name": "m"}',
    '{"tokens_b64": "AQAAAA==" "model_name": "m"}',
    '{"tokens_b64": "AQAAAA==", "model_name": "m"} x',
    '{"tokens_b64": "AQAAAA==", "model_name": "m"',
    '{"tokens_b64": "AQAAAA==',
    '{"tokens_b64": "AQAAAA==", "model_name": "m", "cache_salt": 7}',
    '{"tokens_b64": "AQAAAA==", "model_name": "m", "unknown": {"deep": [1, 2]}}',
]


def test_hand_picked_bodies_decode_alike() -> None:
    for text in HAND_PICKED:
        assert_same(text.encode())
    assert_same(b'{"tokens_b64": "AQAA\xffAA==", "model_name": "m"}')  # not UTF-8
    assert_same(b'{"model_name": "\xff", "tokens_b64": "AQAAAA=="}')
    assert_same(b"\xef\xbb\xbf" + HAND_PICKED[0].encode())  # a byte-order mark


def test_the_hot_path_is_taken_for_a_plain_body() -> None:
    """Not a behaviour, but what the equivalence above is worth: the split is really used."""
    body, decoded = decode_blend_lookup(HAND_PICKED[1].encode(), MAX_TOKENS)
    assert decoded is not None and body.tokens_b64 is None and body.model_name == "m"
    body, decoded = decode_blend_lookup(HAND_PICKED[15].encode(), MAX_TOKENS)
    assert decoded is None and body.tokens_b64 == "AQAA AA=="


_KEYS = st.sampled_from(
    [
        *('"tokens_b64"', ESCAPED_KEY, '"model_name"', '"cache_salt"', '"world_size"'),
        *('"token_ids"', '"other"', '"tokens_b64 "', "tokens_b64", '"meta"'),
    ]
)
_STRINGS = st.sampled_from(
    [
        *(VALID, _b64(MAX_TOKENS), _b64(MAX_TOKENS + 1), _b64(MAX_TOKENS * 2), "", "AAAAAA=="),
        *("AQAA AA==", "AQAAAA\\/=", "AQAAAA==\\n", "AQAAAA!=", "AQ==AAAA", "AQAAAA", "m", "é"),
        *("tokens_b64", '\\"tokens_b64\\": \\"AQAAAA==\\"', "-_-_", "q,"),
    ]
)
_VALUES = st.one_of(
    _STRINGS.map(lambda s: f'"{s}"'),
    st.sampled_from(["null", "5", "0", "-1", "2", "[1]", "[]", "true", '{"tokens_b64": "AA=="}']),
)
_SPACE = st.sampled_from(["", " ", "\n\t", "  "])
_GLUE = st.sampled_from([",", ",", ",", ",,", "", " , "])


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(st.tuples(_KEYS, _SPACE, _VALUES, _SPACE, _GLUE), max_size=5),
    _SPACE,
    st.sampled_from(["{", "{", "[", ""]),
    st.sampled_from(["}", "}", "}", "", "} x", "]"]),
)
@example(
    [('"tokens_b64"', "", f'"{VALID}"', "", ","), ('"model_name"', "", '"m"', "", "")], "", "{", "}"
)
def test_random_bodies_decode_alike(
    members: list[tuple[str, str, str, str, str]], space: str, opening: str, closing: str
) -> None:
    parts = [f"{key}{before}:{after}{value}" for key, before, value, after, _ in members]
    text = opening + space
    for k, part in enumerate(parts):
        text += part + (members[k][4] if k < len(parts) - 1 else "")
    assert_same((text + space + closing).encode())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=MAX_TOKENS + 2),
    st.dictionaries(
        st.sampled_from(["model_name", "cache_salt", "world_size", "token_ids", "x"]),
        st.one_of(st.text(max_size=4), st.integers(-2, 3), st.none()),
    ),
    st.booleans(),
)
def test_json_encoded_bodies_decode_alike(
    tokens: list[int], others: dict[str, Any], first: bool
) -> None:
    encoded = base64.b64encode(np.array(tokens, dtype="<u4").tobytes()).decode()
    body = {"tokens_b64": encoded, **others} if first else {**others, "tokens_b64": encoded}
    assert_same(json.dumps(body).encode())
