"""mm_hash_to_token_values: the contract's vectors and every pinned property."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.keys import clear_value_cache, mm_hash_to_token_values, mm_hash_values
from kvatlas.keys._sha256_lanes import counter_block_words


def reference_values(identifier: object, length: int) -> tuple[int, ...]:
    """The contract written as the plain per-block loop."""
    seed = hashlib.sha256(str(identifier).encode("utf-8")).digest()
    out: list[int] = []
    for c in range((length + 7) // 8):
        block = hashlib.sha256(seed + c.to_bytes(8, "big")).digest()
        out.extend(w & 0x7FFFFFFF for w in struct.unpack(">8I", block))
    return tuple(out[:length])


def test_vector_some_image_hash() -> None:
    assert mm_hash_to_token_values("some-image-hash", 10) == (
        800211838, 33285174, 1985384225, 1695914038, 524546018,
        253856904, 73296868, 1400152113, 695992699, 2039537335,
    )  # fmt: skip


def test_vector_empty_identifier() -> None:
    assert mm_hash_to_token_values("", 3) == (1549615836, 1939829184, 577546016)


def test_zero_and_negative_length() -> None:
    assert mm_hash_to_token_values("x", 0) == ()
    with pytest.raises(ValueError):
        mm_hash_to_token_values("x", -1)


@pytest.mark.parametrize("length", [np.int64(10), np.int32(10), np.uint16(10)])
def test_a_numpy_integer_length_gives_the_vector(length: int) -> None:
    """LMCache takes any integer length (``range(ceil(length / 8))``) and engines compute span
    lengths as numpy or torch integers: the values are the same as for the Python int."""
    assert mm_hash_to_token_values("some-image-hash", length) == reference_values(
        "some-image-hash", 10
    )


@pytest.mark.parametrize("length", [np.int64(-1), True, np.bool_(True), 2.0, "3"])
def test_a_negative_bool_or_non_integer_length_is_refused(length: int) -> None:
    with pytest.raises(ValueError, match="length"):
        mm_hash_to_token_values("some-image-hash", length)


@settings(max_examples=50, deadline=None)
@given(
    identifier=st.one_of(st.text(max_size=20), st.integers(), st.binary(max_size=8)),
    length=st.integers(0, 300),
)
def test_bit_identical_to_reference(identifier: object, length: int) -> None:
    clear_value_cache()
    assert mm_hash_to_token_values(identifier, length) == reference_values(identifier, length)


def test_kernel_bit_identical_across_tiles_and_high_counters() -> None:
    seed = hashlib.sha256(b"tile").digest()
    for first in (0, 63, 64, (1 << 32) - 3, (1 << 40) + 5):
        words = counter_block_words(seed, first, 130)
        expected = b"".join(
            hashlib.sha256(seed + c.to_bytes(8, "big")).digest() for c in range(first, first + 130)
        )
        assert words.astype(">u4").tobytes() == expected


def test_non_string_identifiers_are_stringified() -> None:
    assert mm_hash_to_token_values(12345, 9) == mm_hash_to_token_values("12345", 9)


def test_determinism_and_range() -> None:
    a = mm_hash_values("img", 4096)
    clear_value_cache()
    b = mm_hash_values("img", 4096)
    assert np.array_equal(a, b)
    assert int(a.max()) < 1 << 31 and int(a.min()) >= 0


def test_position_dependence() -> None:
    assert len(set(mm_hash_to_token_values("img-A", 128))) > 120


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 255, 299])
def test_prefix_stability(n: int) -> None:
    clear_value_cache()
    longest = mm_hash_to_token_values("stable", 299)
    assert mm_hash_to_token_values("stable", n) == longest[:n]
    clear_value_cache()
    assert mm_hash_to_token_values("stable", n) == longest[:n]


def test_cache_extension_matches_cold_values() -> None:
    clear_value_cache()
    mm_hash_to_token_values("grow", 5)
    grown = mm_hash_to_token_values("grow", 1000)
    clear_value_cache()
    assert grown == mm_hash_to_token_values("grow", 1000)


def test_cached_values_are_read_only() -> None:
    values = mm_hash_values("ro", 16)
    with pytest.raises(ValueError):
        values[0] = 1


def test_distinct_identifiers_agree_in_at_most_one_of_32() -> None:
    base = mm_hash_to_token_values("image-0", 32)
    for i in range(1, 500):
        other = mm_hash_to_token_values(f"image-{i}", 32)
        assert sum(x == y for x, y in zip(base, other, strict=True)) <= 1


def test_historic_16_bit_truncation_regression() -> None:
    """0x1234 and 0x11234 were equal under the old 16-bit scheme (LMCache issue #3301)."""
    assert 0x1234 & 0xFFFF == 0x11234 & 0xFFFF
    assert mm_hash_to_token_values(0x1234, 16) != mm_hash_to_token_values(0x11234, 16)
    assert mm_hash_to_token_values("0x1234", 16) != mm_hash_to_token_values("0x11234", 16)


_WARM_UP = """
import json
from kvatlas.keys import mm_hash_values, mm_values, warm_up_mm_values
from kvatlas.keys._sha256_lanes import _counter_blocks
warm_up_mm_values()
warmed = sorted(map(str, _counter_blocks.signatures))
cached = len(mm_values._CACHE._entries)
mm_hash_values("an image", 20)
print(json.dumps(dict(warmed=warmed, cached=cached,
                      used=sorted(map(str, _counter_blocks.signatures)))))
"""


def test_the_warm_up_readies_the_kernel_a_first_image_uses_and_caches_no_values() -> None:
    """In a fresh process (in this one, other tests compiled it already)."""
    run = subprocess.run(
        [sys.executable, "-c", _WARM_UP], capture_output=True, text=True, check=True, timeout=600
    )
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["warmed"] and seen["used"] == seen["warmed"]  # the first image compiles nothing
    assert seen["cached"] == 0


def test_a_node_warms_the_multimodal_kernel_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_node`` warms it right after the directory's kernels, before building the node."""
    from kvatlas.node import server
    from kvatlas.node.config import NodeConfig

    calls: list[str] = []

    class Built(Exception):
        pass

    def building(*args: object, **kwargs: object) -> None:
        raise Built

    monkeypatch.setattr(server, "configure_logging", lambda *args: None)
    monkeypatch.setattr(server, "bind_listener", lambda host, port: None)
    monkeypatch.setattr(server, "warm_up_kernels", lambda: calls.append("directory"))
    monkeypatch.setattr(server, "warm_up_mm_values", lambda: calls.append("keys"))
    monkeypatch.setattr(server, "NodeProcess", building)
    with pytest.raises(Built):
        server.run_node(NodeConfig())
    assert calls == ["directory", "keys"]
