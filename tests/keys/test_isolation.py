"""Cross-image isolation and traffic scenarios for multimodal keys, under both key schemes.

Every test goes through :class:`RequestTracker`, the single injection point: image identity is
substituted into the placeholder span once, and keys come from the tracker's token ids. The
negative control re-implements the historic 16-bit scheme (one value repeated over the span)
in this file only, to show the workload is one that *does* collide without per-position values.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from functools import cache
from typing import Any

import numpy as np
import pytest

from kvatlas.keys import (
    BypassGuard,
    KeyScheme,
    MMItem,
    RequestTracker,
    chunk_hashes,
    clear_value_cache,
    mm_hash_to_token_values,
)

SCHEME_NAMES = ("blake3", "blake3-x1")
PLACEHOLDER = 151655  # what an engine writes into every image span, whatever the image

# The 10k-image workload: text | image | text, chunk size 16, span over chunks 1..3.
C = 16
N_IMAGES = 10_000
PREFIX = list(range(1000, 1020))  # 20 text tokens: chunk 0 is pure text
IMG_OFFSET, IMG_LEN = len(PREFIX), 40  # [20, 60): chunks 1, 2, 3 cover placeholders
SUFFIX = list(range(2000, 2020))  # chunk 4 is text after the image
PROMPT = PREFIX + [PLACEHOLDER] * IMG_LEN + SUFFIX
COVERING = range(1, 4)


def image_id(i: int) -> str:
    """Engine-style identifiers: hex digests of the image bytes."""
    return hashlib.sha256(f"image-{i}".encode()).hexdigest()


def historic_value(identifier: str) -> int:
    """The historic scheme (LMCache issue #3301): 16 bits of the identifier, one value per span."""
    return int(identifier, 16) & 0xFFFF


def tracker(
    prompt: Any, items: list[MMItem], scheme: KeyScheme, guard: BypassGuard | None = None
) -> RequestTracker:
    return RequestTracker(prompt, items, scheme=scheme, guard=guard or BypassGuard())


def brute_force(prompt: list[int], items: list[MMItem]) -> list[int]:
    out = list(prompt)
    for item in items:
        values = mm_hash_to_token_values(item.identifier, item.span.length)
        for k, value in enumerate(values):
            out[item.span.offset + k] = value
    return out


@cache
def workload_keys(scheme_name: str) -> tuple[tuple[bytes, ...], ...]:
    """Keys of the 10k same-shape images through the tracker (computed once per scheme)."""
    scheme = KeyScheme(scheme_name, C)
    guard = BypassGuard()
    keys = []
    for i in range(N_IMAGES):
        t = RequestTracker(
            PROMPT, [MMItem.of(image_id(i), IMG_OFFSET, IMG_LEN)], scheme=scheme, guard=guard
        )
        keys.append(tuple(t.chunk_hashes()))
    assert guard.count == 0
    return tuple(keys)


# --------------------------------------------------------------------------- 10k-image isolation


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_10k_same_shape_images_share_no_placeholder_chunk(scheme_name: str) -> None:
    keys = workload_keys(scheme_name)
    assert len(keys) == N_IMAGES
    assert all(len(k) == len(PROMPT) // C for k in keys)
    # Identical surrounding text: the pure-text chunk before the image is shared by everyone.
    assert len({k[0] for k in keys}) == 1
    covering = [k[c] for k in keys for c in COVERING]
    assert len(covering) == N_IMAGES * len(COVERING)
    assert len(set(covering)) == len(covering), "two images share a placeholder chunk key"
    # The text after the image inherits the image's identity through the chain.
    assert len({k[4] for k in keys}) == N_IMAGES


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_same_image_twice_gives_identical_keys(scheme_name: str) -> None:
    keys = workload_keys(scheme_name)
    scheme = KeyScheme(scheme_name, C)
    clear_value_cache()  # recompute the values: identity must not depend on a warm cache
    for i in range(0, N_IMAGES, 97):
        again = tracker(
            np.asarray(PROMPT, dtype=np.int64),
            [MMItem.of(image_id(i), IMG_OFFSET, IMG_LEN)],
            scheme,
        )
        assert tuple(again.chunk_hashes()) == keys[i]


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_negative_control_historic_16bit_values_collide(scheme_name: str) -> None:
    """Same workload, one 16-bit value repeated over the span: hundreds of colliding pairs."""
    scheme = KeyScheme(scheme_name, C)
    by_key: Counter[tuple[bytes, ...]] = Counter()
    by_value: Counter[int] = Counter()
    for i in range(N_IMAGES):
        value = historic_value(image_id(i))
        tokens = PREFIX + [value] * IMG_LEN + SUFFIX
        by_key[tuple(scheme.chunk_hashes(tokens)[c] for c in COVERING)] += 1
        by_value[value] += 1
    pairs = sum(n * (n - 1) // 2 for n in by_key.values())
    # Birthday bound: C(10000, 2) / 65536 ≈ 763 expected colliding pairs.
    assert 400 < pairs < 1200
    assert pairs == sum(n * (n - 1) // 2 for n in by_value.values())
    # The tracker on the very same identifiers: zero colliding pairs (checked chunk by chunk).
    real = Counter(tuple(k[c] for c in COVERING) for k in workload_keys(scheme_name))
    assert max(real.values()) == 1


def test_historic_truncation_pair_is_kept_apart() -> None:
    """0x1234 and 0x11234 are equal under the historic truncation (issue #3301), not here."""
    assert historic_value("1234") == historic_value("11234")
    for name in SCHEME_NAMES:
        scheme = KeyScheme(name, C)
        a = tracker(PROMPT, [MMItem.of(0x1234, 20, 40)], scheme).chunk_hashes()
        b = tracker(PROMPT, [MMItem.of(0x11234, 20, 40)], scheme).chunk_hashes()
        assert a[0] == b[0]
        assert all(a[c] != b[c] for c in COVERING)


# ------------------------------------------------------------------------------------ scenarios


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_spans_straddling_chunk_boundaries_at_every_phase(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    length = 2 * C + 5  # always straddles at least two boundaries
    for phase in range(C):
        offset = 2 * C + phase
        prompt = list(range(500, 500 + offset)) + [PLACEHOLDER] * length + list(range(40))
        first_chunk, last_chunk = offset // C, (offset + length - 1) // C
        n_chunks = len(prompt) // C
        a = tracker(prompt, [MMItem.of("cat.png", offset, length)], scheme)
        b = tracker(prompt, [MMItem.of("dog.png", offset, length)], scheme)
        ka, kb = a.chunk_hashes(), b.chunk_hashes()
        assert len(ka) == len(kb) == n_chunks
        assert ka[:first_chunk] == kb[:first_chunk], f"phase {phase}: text prefix not shared"
        for c in range(first_chunk, n_chunks):
            assert ka[c] != kb[c], f"phase {phase}: chunk {c} shared by two images"
        assert list(a.get_token_ids()) == brute_force(prompt, list(a.items))
        again = tracker(prompt, [MMItem.of("cat.png", offset, length)], scheme)
        assert again.chunk_hashes() == ka
        assert last_chunk < n_chunks


def test_mixed_traffic_blake3_text_only_keys_are_plain_chunk_hashes() -> None:
    scheme = KeyScheme("blake3", C)
    rng = np.random.default_rng(7)
    shared_text = rng.integers(0, 150_000, size=3 * C).tolist()
    for n in (0, 5, C, 3 * C, 7 * C + 3):
        text = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).tolist()
        assert tracker(text, [], scheme).chunk_hashes() == chunk_hashes(text, C)
    # A multimodal request interleaved with the text-only traffic: the text-only request keys
    # exactly as before, and both share the chunks of their common pure-text prefix.
    text_only = shared_text + rng.integers(0, 150_000, size=2 * C).tolist()
    mm_prompt = shared_text + [PLACEHOLDER] * C
    mm = tracker(mm_prompt, [MMItem.of("img", 3 * C, C)], scheme)
    text = tracker(text_only, [], scheme)
    assert text.chunk_hashes() == chunk_hashes(text_only, C)
    assert mm.chunk_hashes()[:3] == text.chunk_hashes()[:3]
    assert mm.chunk_hashes()[3] != chunk_hashes(mm_prompt, C)[3]


def test_mixed_traffic_x1_text_only_keys_are_domain_separated_and_stable() -> None:
    x1, plain = KeyScheme("blake3-x1", C), KeyScheme("blake3", C)
    rng = np.random.default_rng(8)
    text = rng.integers(0, 150_000, size=5 * C + 7).tolist()
    x1_keys = tracker(text, [], x1).chunk_hashes()
    plain_keys = tracker(text, [], plain).chunk_hashes()
    assert len(x1_keys) == len(plain_keys) == 5
    assert not set(x1_keys) & set(plain_keys), "x1 keys must never equal blake3 keys"
    assert tracker(list(text), [], x1).chunk_hashes() == x1_keys  # stable
    assert tracker(np.asarray(text, dtype=np.int32), [], x1).chunk_hashes() == x1_keys
    # Multimodal traffic next to it still shares the pure-text prefix under x1.
    mm = tracker(text[: 2 * C] + [PLACEHOLDER] * C, [MMItem.of("img", 2 * C, C)], x1)
    assert mm.chunk_hashes()[:2] == x1_keys[:2]
    assert mm.chunk_hashes()[2] != x1_keys[2]
    # The whole 10k workload under x1 never meets a blake3 key.
    assert not {k for ks in workload_keys("blake3-x1") for k in ks} & {
        k for ks in workload_keys("blake3") for k in ks
    }


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_several_images_in_one_prompt(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    # text(24) | a [24, 54) | text(10) | b [64, 94) | text(6) | c [100, 150) | text(40)
    spans = [(24, 30), (64, 30), (100, 50)]
    prompt = (
        list(range(300, 324))
        + [PLACEHOLDER] * 30
        + list(range(700, 710))
        + [PLACEHOLDER] * 30
        + list(range(710, 716))
        + [PLACEHOLDER] * 50
        + list(range(900, 940))
    )
    assert len(prompt) == 190
    ids = ["a.png", "b.png", "c.png"]

    def keys(order: list[str]) -> list[bytes]:
        items = [MMItem.of(i, off, n) for i, (off, n) in zip(order, spans, strict=True)]
        t = tracker(prompt, items, scheme)
        assert t.cacheable
        assert list(t.get_token_ids()) == brute_force(prompt, items)
        return t.chunk_hashes()

    base = keys(ids)
    assert keys(ids) == base  # same images, same order: reproduced
    first_image_chunk = spans[0][0] // C
    swapped_ab = keys(["b.png", "a.png", "c.png"])
    assert swapped_ab[:first_image_chunk] == base[:first_image_chunk]
    assert all(
        x != y
        for x, y in zip(swapped_ab[first_image_chunk:], base[first_image_chunk:], strict=True)
    )
    swapped_bc = keys(["a.png", "c.png", "b.png"])
    second_image_chunk = spans[1][0] // C
    assert swapped_bc[:second_image_chunk] == base[:second_image_chunk]
    assert all(
        x != y
        for x, y in zip(swapped_bc[second_image_chunk:], base[second_image_chunk:], strict=True)
    )
    # The same image twice in one prompt is not the same content at both places.
    twice = keys(["a.png", "a.png", "c.png"])
    assert twice != base
    assert len(set(twice)) == len(twice)


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_video_length_span(scheme_name: str) -> None:
    chunk = 64
    scheme = KeyScheme(scheme_name, chunk)
    offset, length = 37, 5_000
    prompt = list(range(10, 10 + offset)) + [PLACEHOLDER] * length + list(range(100))
    a = tracker(prompt, [MMItem.of("video-1.mp4", offset, length)], scheme)
    b = tracker(prompt, [MMItem.of("video-2.mp4", offset, length)], scheme)
    ka, kb = a.chunk_hashes(), b.chunk_hashes()
    assert len(ka) == len(prompt) // chunk
    assert not set(ka) & set(kb)  # the first chunk already covers placeholders at offset 37
    tokens = a.get_token_ids()
    assert list(tokens) == brute_force(prompt, list(a.items))
    assert int(tokens[offset : offset + length].max()) < 1 << 31
    # Position dependence: no two chunks of the video carry the same token content, so even a
    # chain-less (segment) store could not confuse frame 1 with frame 40.
    inner = tokens[offset : offset + length - length % chunk].reshape(-1, chunk)
    assert len({row.tobytes() for row in inner}) == len(inner)
    assert tracker(prompt, [MMItem.of("video-1.mp4", offset, length)], scheme).chunk_hashes() == ka


# ------------------------------------------------------------------------- blake3-x1 specifics


def test_x1_chunk_with_extra_keys_never_equals_one_without() -> None:
    x1 = KeyScheme("blake3-x1", C)
    rng = np.random.default_rng(9)
    for _ in range(50):
        tokens = rng.integers(0, 1 << 31, size=4 * C).tolist()
        off = int(rng.integers(0, 3 * C))
        items = [MMItem.of(f"img-{off}", off, C)]
        # Identical (already substituted) token content; only the extra keys differ.
        with_items = x1.chunk_hashes(tokens, items)
        without = x1.chunk_hashes(tokens)
        covered = {c for c in range(4) if c * C < off + C and (c + 1) * C > off}
        for c in range(4):
            if c < min(covered):
                assert with_items[c] == without[c]
            else:
                assert with_items[c] != without[c]
        assert not set(with_items) & set(chunk_hashes(tokens, C))
        lora = x1.chunk_hashes(tokens, request_keys={"lora": "x"})
        assert all(x != y for x, y in zip(lora, without, strict=True))


def test_x1_same_item_at_another_phase_is_another_key() -> None:
    x1 = KeyScheme("blake3-x1", C)
    tokens = [PLACEHOLDER] * (4 * C)  # raw identical tokens for every variant
    seen: dict[bytes, int] = {}
    for phase in range(C):
        first = x1.chunk_hashes(tokens, [MMItem.of("img", C + phase, 2 * C)])[1]
        assert first not in seen, f"phase {phase} keyed like phase {seen.get(first)}"
        seen[first] = phase
    # Same overlap inside the chunk but a different offset within the item: another key too.
    a = x1.chunk_hashes(tokens, [MMItem.of("img", 0, 3 * C)])[1]  # chunk 1 = item[16:32]
    b = x1.chunk_hashes(tokens, [MMItem.of("img", C, 2 * C)])[1]  # chunk 1 = item[0:16]
    assert a != b
    # Through the tracker the substituted tokens differ as well; keys stay apart.
    prompt = [PLACEHOLDER] * (4 * C)
    keys = {
        tuple(tracker(prompt, [MMItem.of("img", p, 2 * C)], x1).chunk_hashes()) for p in range(C)
    }
    assert len(keys) == C


def test_x1_items_and_order_are_canonical() -> None:
    """Items given in any order key the same: the prompt order is canonical, not the list's."""
    prompt = [PLACEHOLDER] * (6 * C)
    items = [MMItem.of("a", 3, 20), MMItem.of("b", 30, 40), MMItem.of("c", 75, 10)]
    for name in SCHEME_NAMES:
        scheme = KeyScheme(name, C)
        base = tracker(prompt, items, scheme).chunk_hashes()
        for perm in itertools.permutations(items):
            assert tracker(prompt, list(perm), scheme).chunk_hashes() == base
