"""Golden vectors for scheme ``blake3-x1``: a change to its canonical encoding re-keys the fleet.

The oracle is an encoder written here from the description in docs/keys.md ("blake3-x1
canonical encoding"), using only ``blake3`` and ``hashlib``; it shares no code with
``kvatlas.keys``. Both it and the library must reproduce the pinned hex, and the pinned hex is
the one printed in docs/keys.md.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from blake3 import blake3

from kvatlas.keys import KeyScheme, MMItem, RequestTracker

C = 16
PLACEHOLDER = 32000
DOCS = Path(__file__).resolve().parents[2] / "docs" / "keys.md"

Item = tuple[str, int, int]  # identifier, offset, length
RequestKeys = dict[str, str | int]

# name -> (prompt length, items, request keys)
CASES: dict[str, tuple[int, list[Item], RequestKeys]] = {
    "GOLDEN_ONE_ITEM": (48, [("img-a", 4, 8)], {}),
    "GOLDEN_LORA_NAME": (32, [], {"lora": "adapter-a"}),
    "GOLDEN_LORA_INT": (32, [], {"lora": 7}),
    "GOLDEN_SEVERAL": (32, [("b", 8, 4), ("a", 2, 3), ("c", 13, 3)], {}),
    "GOLDEN_CROSSING": (48, [("img-x", 10, 30)], {}),
}

GOLDEN: dict[str, list[str]] = {
    "GOLDEN_ONE_ITEM": [
        "c15879d9188d532327cf84f48e9949367759e5231cffe631f984f0a9f4d6da05",
        "14c47f6af0a6f6175e646f499e1fcd663c852f06367a7ba83f4eae007235e894",
        "04d94c96f110fe9ffef4613a2bbcf366ff2b4e30b158ec7474b1063a16ff288d",
    ],
    "GOLDEN_LORA_NAME": [
        "fe5d947493a65f90d188616186e48c23c32a1a030c51e670035ed31a9782cf1c",
        "569f525b4023a295814e9c6d1e0592cbe67e23e85cc76849d8141f86eed94cac",
    ],
    "GOLDEN_LORA_INT": [
        "990ff613b8886af29348814d4543087b1596934b2a743fcf600a17a079fbc89c",
        "ea03f99694d2ce915c60b1895388606f4bde3349dafb6048bca0719f508be972",
    ],
    "GOLDEN_SEVERAL": [
        "87ee8b2532f677f13132ba00f062062578541c3b4f2095f39063397f78db78eb",
        "55b42da79cc5a22ce0f86cfcc7dbec2a645f81fb0007be49b97459d211a0eb1f",
    ],
    "GOLDEN_CROSSING": [
        "cf7516ee72d779b182725d7408654b5065729befc70839e7e0025a1c7bc1d180",
        "807eff588ee4b97aaa4c4bd3c1057b0c172cd1ccb0416371393c8d2ca5c841c7",
        "b70e49556b09be956a5c225a80fe5e19d65a61235a572208f9ac6713fbbcdd9c",
    ],
}


# --------------------------------------------------------------- independent encoder (docs)


def u32(n: int) -> bytes:
    return n.to_bytes(4, "big")


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return u32(len(raw)) + raw


def identity_values(identifier: str, length: int) -> list[int]:
    """seed = SHA-256(identifier); block c = SHA-256(seed || u64(c)): 8 words & 0x7FFFFFFF."""
    seed = hashlib.sha256(identifier.encode("utf-8")).digest()
    out: list[int] = []
    block = 0
    while len(out) < length:
        digest = hashlib.sha256(seed + u64(block)).digest()
        out += [int.from_bytes(digest[k : k + 4], "big") & 0x7FFFFFFF for k in range(0, 32, 4)]
        block += 1
    return out[:length]


def prompt_of(n: int, items: list[Item]) -> list[int]:
    spans = [(o, o + n_) for _, o, n_ in items]
    return [PLACEHOLDER if any(a <= p < b for a, b in spans) else 1000 + p for p in range(n)]


def substituted(prompt: list[int], items: list[Item]) -> list[int]:
    out = list(prompt)
    for identifier, offset, length in items:
        out[offset : offset + length] = identity_values(identifier, length)
    return out


def request_part(keys: RequestKeys) -> bytes:
    out = b"R" + u32(len(keys))
    for name in sorted(keys):
        value = keys[name]
        out += text(name)
        out += b"s" + text(value) if isinstance(value, str) else b"i" + text(str(value))
    return out


def item_part(i: int, items: list[Item]) -> bytes:
    lo, hi = i * C, (i + 1) * C
    overlapping = [
        it
        for it in sorted(items, key=lambda it: (it[1], it[2]))
        if it[1] < hi and it[1] + it[2] > lo
    ]
    out = b"M" + u32(len(overlapping))
    for identifier, offset, length in overlapping:
        first, last = max(lo, offset), min(hi, offset + length)
        out += text(identifier) + u64(first - offset) + u32(first - lo) + u32(last - first)
    return out


def x1_hashes(n: int, items: list[Item], keys: RequestKeys) -> list[str]:
    tokens = substituted(prompt_of(n, items), items)
    prev = blake3(bytes(12)).digest()
    out = []
    for i in range(n // C):
        data = b"".join(u32(t) for t in tokens[i * C : (i + 1) * C])
        tag = b"\x00kvatlas/blake3-x1\x00"
        r = request_part(keys) if i == 0 else b"R" + u32(0)
        prev = blake3(prev + data + tag + r + item_part(i, items)).digest()
        out.append(prev.hex())
    return out


# ------------------------------------------------------------------------------------- tests


def test_encoder_follows_the_documented_layout() -> None:
    """Spot-check the oracle against hand-written bytes (so it cannot drift with the library)."""
    assert len(b"\x00kvatlas/blake3-x1\x00") == 19
    assert request_part({}) == b"R\x00\x00\x00\x00"
    assert (
        request_part({"lora": 7}) == b"R" + u32(1) + b"\x00\x00\x00\x04lora" + b"i\x00\x00\x00\x017"
    )
    assert item_part(1, [("x", 10, 30)]) == (
        b"M\x00\x00\x00\x01" + b"\x00\x00\x00\x01x" + u64(6) + u32(0) + u32(16)
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_independent_encoder_reproduces_the_golden_vector(name: str) -> None:
    assert x1_hashes(*CASES[name]) == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_library_reproduces_the_golden_vector(name: str) -> None:
    n, items, keys = CASES[name]
    tracker = RequestTracker(
        prompt_of(n, items),
        [MMItem.of(*item) for item in items],
        scheme=KeyScheme("blake3-x1", C),
        request_keys=keys,
    )
    assert tracker.cacheable
    assert [h.hex() for h in tracker.chunk_hashes()] == GOLDEN[name]


def test_docs_print_the_golden_vectors() -> None:
    docs = DOCS.read_text(encoding="utf-8")
    for name, hashes in GOLDEN.items():
        assert name in docs
        found = re.search("`" + re.escape(name) + r"`[^\n]*\n\n```\n((?:[0-9a-f]{64}\n)+)```", docs)
        assert found is not None, name
        assert found.group(1).split() == hashes, name
