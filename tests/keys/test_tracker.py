"""RequestTracker: the single injection point, the multimodal bypass guard, incremental keys.

Oracles: a brute-force substitution (values written position by position into a copy) and
plain ``chunk_hashes`` of that copy under scheme ``blake3``; a brute-force span validity check
for the bypass guard; one-shot hashing of ``get_token_ids()`` for the incremental chain.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.keys import (
    BypassGuard,
    KeyScheme,
    MMItem,
    ObjectKey,
    PlaceholderSpan,
    RequestTracker,
    chunk_hashes,
    mm_hash_to_token_values,
    pack_kv_rank,
    unpack_kv_rank,
)
from tests.torch_support import require_torch

SCHEME_NAMES = ("blake3", "blake3-x1")
PLACEHOLDER = 32000
C = 16


def brute_force(prompt: list[int], items: list[MMItem]) -> list[int]:
    out = list(prompt)
    for item in items:
        for k, value in enumerate(mm_hash_to_token_values(item.identifier, item.span.length)):
            out[item.span.offset + k] = value
    return out


def image_prompt(text_before: int = 20, image: int = 40, text_after: int = 20) -> list[int]:
    return (
        list(range(100, 100 + text_before))
        + [PLACEHOLDER] * image
        + list(range(200, 200 + text_after))
    )


# ---------------------------------------------------------------- negative control: no bypass


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_bypassing_the_tracker_collides_and_the_tracker_never_does(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    prompt = image_prompt()
    n_chunks = len(prompt) // C
    # Engine view: image A and image B produce the very same placeholder prompt.
    raw_a, raw_b = chunk_hashes(prompt, C), chunk_hashes(list(prompt), C)
    assert raw_a == raw_b and len(raw_a) == n_chunks  # the bypassing path collides
    keys: dict[tuple[bytes, ...], str] = {}
    for k in range(200):
        ident = f"image-{k}"
        t = RequestTracker(prompt, [MMItem.of(ident, 20, 40)], scheme=scheme, guard=BypassGuard())
        got = tuple(t.chunk_hashes())
        assert len(got) == n_chunks
        # Chunk 0 is pure text: shared with the raw path under blake3, domain-separated in x1.
        assert (got[0] == raw_a[0]) is (scheme_name == "blake3")
        assert not set(got[1:]) & set(raw_a), "tracker key equals a placeholder-only key"
        assert got not in keys, f"{ident} collides with {keys.get(got)}"
        keys[got] = ident
        # Every key-carrying path derives from the tracker's chain.
        pk = t.prefix_keys("m", world_size=2)
        assert [k.chunk_hash for k in pk[::2]] == list(got)
        assert t.chunk_hashes(num_tokens=t.prompt_len) == list(got)
    assert len({g[1] for g in keys}) == 200


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: list(p), id="list"),
        pytest.param(lambda p: tuple(p), id="tuple"),
        pytest.param(lambda p: np.asarray(p, dtype=np.int64), id="int64"),
        pytest.param(lambda p: np.asarray(p, dtype=np.int32), id="int32"),
        pytest.param(lambda p: np.asarray(p, dtype=np.uint32), id="uint32"),
        pytest.param(lambda p: np.asarray(p, dtype=np.uint32)[:], id="uint32-view"),
    ],
)
@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_tracker_does_not_mutate_the_callers_prompt(make: Any, scheme_name: str) -> None:
    prompt = image_prompt()
    given_prompt = make(prompt)
    before = list(given_prompt)
    t = RequestTracker(
        given_prompt,
        [MMItem.of("img", 20, 40)],
        scheme=KeyScheme(scheme_name, C),
        guard=BypassGuard(),
    )
    assert list(given_prompt) == before
    assert list(t.get_token_ids()) == brute_force(prompt, list(t.items))
    assert (
        t.chunk_hashes()
        == RequestTracker(
            prompt, [MMItem.of("img", 20, 40)], scheme=KeyScheme(scheme_name, C)
        ).chunk_hashes()
    )
    # The tracker's own copy cannot be edited behind its back either.
    with pytest.raises(ValueError):
        t.get_token_ids()[0] = 1


def test_tracker_does_not_mutate_a_torch_prompt() -> None:
    torch = require_torch()
    prompt = image_prompt()
    for dtype in (torch.int64, torch.int32):
        tensor = torch.tensor(prompt, dtype=dtype)
        t = RequestTracker(tensor, [MMItem.of("img", 20, 40)], scheme=KeyScheme("blake3", C))
        assert tensor.tolist() == prompt
        assert list(t.get_token_ids()) == brute_force(prompt, list(t.items))
        assert t.chunk_hashes() == chunk_hashes(brute_force(prompt, list(t.items)), C)


# -------------------------------------------------------------------------------- bypass guard

BROKEN_ITEMS = {
    "empty-identifier": [MMItem("", PlaceholderSpan(20, 40))],
    "span-past-prompt": [MMItem.of("img", 60, 40)],
    "span-starting-past-prompt": [MMItem.of("img", 80, 4)],
    "overlapping-spans": [MMItem.of("a", 20, 20), MMItem.of("b", 30, 20)],
    "overlap-given-out-of-order": [MMItem.of("b", 30, 20), MMItem.of("a", 20, 20)],
    "one-good-one-past-the-end": [MMItem.of("a", 0, 10), MMItem.of("b", 75, 10)],
    "empty-span": [MMItem.of("cat", 20, 0)],
    "empty-span-on-a-chunk-boundary": [MMItem.of("cat", 32, 0)],
    "empty-span-at-prompt-end": [MMItem.of("cat", 80, 0)],
    "empty-span-past-prompt": [MMItem.of("cat", 90, 0)],
    "one-good-one-empty": [MMItem.of("a", 20, 40), MMItem.of("b", 64, 0)],
}


def assert_refused(t: RequestTracker, guard: BypassGuard, caplog: pytest.LogCaptureFixture) -> None:
    assert t.cacheable is False
    assert t.uncacheable_reason
    assert t.chunk_hashes() == []
    assert t.chunk_hashes(num_tokens=32) == []
    assert t.prefix_keys("model") == []
    assert t.prefix_keys("model", world_size=4) == []
    assert guard.count == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("uncacheable" in r.getMessage() for r in warnings), caplog.text


@pytest.mark.parametrize("case", sorted(BROKEN_ITEMS))
@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_bypass_guard_refuses_requests_without_usable_identity(
    case: str, scheme_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    guard = BypassGuard()
    with caplog.at_level(logging.WARNING):
        t = RequestTracker(
            image_prompt(),
            BROKEN_ITEMS[case],
            scheme=KeyScheme(scheme_name, C),
            request_id=f"req-{case}",
            guard=guard,
        )
    assert_refused(t, guard, caplog)
    assert f"req-{case}" in caplog.text
    # The prompt is kept untouched (nothing was keyed by a half-substituted prompt).
    assert list(t.get_token_ids()) == image_prompt()


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_bypass_guard_refuses_a_none_identifier(
    scheme_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``MMItem.of(None, ...)`` must not become the identity "None" shared by every image."""
    guard = BypassGuard()
    try:
        items = [MMItem.of(None, 20, 40)]
    except (TypeError, ValueError):
        return  # refusing to build the item is as good as refusing the request
    with caplog.at_level(logging.WARNING):
        t = RequestTracker(image_prompt(), items, scheme=KeyScheme(scheme_name, C), guard=guard)
    assert_refused(t, guard, caplog)


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_bypass_guard_counts_adapter_problems(
    scheme_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    guard = BypassGuard()
    with caplog.at_level(logging.WARNING):
        t = RequestTracker(
            image_prompt(),
            [MMItem.of("img", 20, 40)],
            scheme=KeyScheme(scheme_name, C),
            problems=["mm_hashes without matching mm_positions"],
            guard=guard,
        )
    assert_refused(t, guard, caplog)
    assert "mm_hashes without matching mm_positions" in caplog.text
    ok = RequestTracker(image_prompt(), [MMItem.of("img", 20, 40)], guard=guard)
    assert ok.cacheable and guard.count == 1  # a good request is not counted


@pytest.mark.parametrize("offset", [20, 32, 80])
@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_empty_span_items_are_refused_not_keyed_alike(offset: int, scheme_name: str) -> None:
    """An item with an empty span leaves no trace in the tokens: "cat" and "dog" would share
    keys (with each other and with the text-only prompt), so the request must be refused."""
    guard = BypassGuard()
    scheme = KeyScheme(scheme_name, C)
    cat = RequestTracker(image_prompt(), [MMItem.of("cat", offset, 0)], scheme=scheme, guard=guard)
    dog = RequestTracker(image_prompt(), [MMItem.of("dog", offset, 0)], scheme=scheme, guard=guard)
    assert not cat.cacheable and not dog.cacheable
    assert cat.chunk_hashes() == dog.chunk_hashes() == []
    assert guard.reasons == {"empty placeholder span": 2}


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_out_of_range_span_is_counted_by_reason(scheme_name: str) -> None:
    guard = BypassGuard()
    scheme = KeyScheme(scheme_name, C)
    for offset, length in [(60, 40), (80, 4), (500, 1)]:
        t = RequestTracker(
            image_prompt(), [MMItem.of("img", offset, length)], scheme=scheme, guard=guard
        )
        assert not t.cacheable
    assert guard.reasons == {"placeholder span outside the prompt": 3}


def test_bypass_guard_counts_by_reason() -> None:
    guard = BypassGuard()
    for _ in range(3):
        guard.refuse("r", "placeholder span outside the prompt: [60, 100)")
    guard.refuse("r", "other: x")
    assert guard.count == 4
    assert guard.reasons["placeholder span outside the prompt"] == 3


@pytest.mark.parametrize("lora", ["adapter-a", 7])
def test_request_keys_under_blake3_make_the_request_uncacheable(
    lora: str | int, caplog: pytest.LogCaptureFixture
) -> None:
    """blake3 has no channel for a LoRA: keying it by tokens alone would serve another
    adapter's KV. The request must be refused (guard + log), not crash the caller."""
    guard = BypassGuard()
    with caplog.at_level(logging.WARNING):
        t = RequestTracker(
            image_prompt(),
            scheme=KeyScheme("blake3", C),
            request_keys={"lora": lora},
            guard=guard,
        )
    assert_refused(t, guard, caplog)


def test_request_keys_under_x1_separate_adapters() -> None:
    x1 = KeyScheme("blake3-x1", C)
    prompt = list(range(5 * C))
    guard = BypassGuard()

    def keys(request_keys: dict[str, str | int] | None) -> list[bytes]:
        t = RequestTracker(prompt, scheme=x1, request_keys=request_keys, guard=guard)
        assert t.cacheable
        return t.chunk_hashes()

    a, b, none = keys({"lora": "a"}), keys({"lora": "b"}), keys(None)
    assert len(a) == 5
    assert a == keys({"lora": "a"})
    for other in (b, none, keys({"lora": 7}), keys({"lora": "7"})):
        assert all(x != y for x, y in zip(a, other, strict=True))
    assert keys({"lora": 7}) != keys({"lora": "7"})  # typed values
    assert guard.count == 0


# ---------------------------------------------------------------- preemption and incremental


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_preemption_recompute_reproduces_prompt_keys(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    prompt = image_prompt(text_before=21, image=45, text_after=9)  # 75 tokens, partial tail
    items = [MMItem.of("photo", 21, 45)]
    first = RequestTracker(prompt, items, scheme=scheme)
    prompt_keys = first.chunk_hashes()
    assert len(prompt_keys) == len(prompt) // C
    generated = list(range(5000, 5000 + 3 * C + 5))
    for k in range(0, len(generated), 7):  # decode in uneven steps
        first.append_generated(generated[k : k + 7])
        first.chunk_hashes()
    full_keys = first.chunk_hashes()
    assert full_keys[: len(prompt_keys)] == prompt_keys
    assert len(full_keys) == (len(prompt) + len(generated)) // C
    # Preempted, then rebuilt for the same request with the generated tokens appended.
    rebuilt = RequestTracker(prompt, items, scheme=scheme)
    rebuilt.append_generated(np.asarray(generated, dtype=np.int64))
    assert rebuilt.chunk_hashes(num_tokens=rebuilt.prompt_len) == prompt_keys
    assert rebuilt.chunk_hashes() == full_keys
    tokens = rebuilt.get_token_ids()
    assert list(tokens[len(prompt) :]) == generated  # generated tokens are untouched
    oneshot = (
        chunk_hashes(tokens, C) if scheme_name == "blake3" else scheme.chunk_hashes(tokens, items)
    )
    assert full_keys == oneshot


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_incremental_chain_extends_instead_of_recomputing(scheme_name: str) -> None:
    t = RequestTracker(
        image_prompt(20, 40, 4), [MMItem.of("img", 20, 40)], scheme=KeyScheme(scheme_name, C)
    )
    chain = t._chain  # the per-request hasher
    assert len(t.chunk_hashes()) == 4
    hashed = chain.chunks_hashed
    t.append_generated([1] * (C - 1))
    assert len(t.chunk_hashes()) == 4
    t.append_generated([2])
    assert len(t.chunk_hashes()) == 5
    assert chain.chunks_hashed == hashed + 1, "the prompt chain was recomputed"
    t.chunk_hashes()
    t.prefix_keys("m")
    assert chain.chunks_hashed == hashed + 1


def test_append_generated_rejects_out_of_range_tokens() -> None:
    t = RequestTracker(list(range(C)), scheme=KeyScheme("blake3", C))
    with pytest.raises(ValueError, match="outside"):
        t.append_generated([1 << 32])
    with pytest.raises(ValueError, match="outside"):
        t.append_generated([-1])
    assert len(t.get_token_ids()) == C


def test_bool_tokens_are_refused_in_the_prompt_and_the_generated_tokens() -> None:
    with pytest.raises(ValueError, match="integers"):
        RequestTracker([True, False] * (C // 2), scheme=KeyScheme("blake3", C))
    t = RequestTracker(list(range(C)), scheme=KeyScheme("blake3", C))
    with pytest.raises(ValueError, match="integers"):
        t.append_generated([7, True])
    assert len(t.get_token_ids()) == C


def test_prefix_keys_carry_namespace_and_ranks() -> None:
    t = RequestTracker(
        image_prompt(), [MMItem.of("img", 20, 40)], scheme=KeyScheme("blake3", C), cache_salt="s"
    )
    hashes = t.chunk_hashes()
    keys = t.prefix_keys("llava", world_size=2, object_group_id=3)
    assert len(keys) == 2 * len(hashes)
    for i, key in enumerate(keys):  # chunk-major, rank-minor
        assert key.chunk_hash == hashes[i // 2]
        assert unpack_kv_rank(key.kv_rank)[:2] == (2, i % 2)
        assert (key.model_name, key.object_group_id, key.cache_salt) == ("llava", 3, "s")
    assert t.prefix_keys("llava", num_tokens=40) == [
        ObjectKey(h, "llava", pack_kv_rank(1, 0, 1, 0), 0, "s") for h in hashes[:2]
    ]
    ns = t.blend_namespace("llava", 2)
    assert (ns.model_name, ns.cache_salt, ns.world_size) == ("llava", "s", 2)


# ------------------------------------------------------------------------------ property tests


@st.composite
def prompts_with_spans(draw: st.DrawFn, valid: bool = True) -> tuple[list[int], list[MMItem]]:
    n = draw(st.integers(0, 6 * C))
    prompt = draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8, unique=True)))
    items = []
    for k in range(0, len(cuts) - 1, 2):
        if valid or draw(st.booleans()):
            lo, hi = cuts[k], cuts[k + 1]
        else:  # possibly overlapping, empty, running past or lying beyond the end
            lo = draw(st.integers(0, n + 4))
            hi = lo + draw(st.integers(0, n + 4))
        items.append(MMItem.of(draw(st.text(min_size=1, max_size=6)), lo, hi - lo))
    if draw(st.booleans()):
        items.reverse()
    return prompt, items


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts_with_spans(), st.integers(1, 2 * C))
def test_tracker_matches_brute_force_substitution(
    case: tuple[list[int], list[MMItem]], chunk: int
) -> None:
    prompt, items = case
    guard = BypassGuard()
    t = RequestTracker(prompt, items, scheme=KeyScheme("blake3", chunk), guard=guard)
    assert t.cacheable and guard.count == 0
    expected = brute_force(prompt, items)
    assert t.get_token_ids().tolist() == expected
    assert t.chunk_hashes() == chunk_hashes(expected, chunk)
    x1 = KeyScheme("blake3-x1", chunk)
    tx = RequestTracker(prompt, items, scheme=x1, guard=guard)
    assert tx.get_token_ids().tolist() == expected
    assert tx.chunk_hashes() == x1.chunk_hashes(expected, items)


def spans_valid(prompt_len: int, items: list[MMItem]) -> bool:
    owner = [-1] * prompt_len
    for k, item in enumerate(items):
        if item.span.length == 0 or item.span.end > prompt_len:
            return False
        for p in range(item.span.offset, item.span.end):
            if owner[p] != -1:
                return False
            owner[p] = k
    return True


@settings(max_examples=200, deadline=None)
@given(prompts_with_spans(valid=False), st.sampled_from(SCHEME_NAMES))
def test_guard_refuses_exactly_the_invalid_span_sets(
    case: tuple[list[int], list[MMItem]], scheme_name: str
) -> None:
    prompt, items = case
    guard = BypassGuard()
    t = RequestTracker(prompt, items, scheme=KeyScheme(scheme_name, C), guard=guard)
    ok = spans_valid(len(prompt), items)
    assert t.cacheable is ok
    assert guard.count == (0 if ok else 1)
    if ok:
        assert t.get_token_ids().tolist() == brute_force(prompt, items)
        assert len(t.chunk_hashes()) == len(prompt) // C
    else:
        assert t.chunk_hashes() == [] and t.get_token_ids().tolist() == prompt


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 32) - 1), max_size=3 * C),
    st.lists(st.lists(st.integers(0, (1 << 32) - 1), max_size=2 * C), max_size=6),
    st.sampled_from(SCHEME_NAMES),
)
def test_incremental_chain_equals_one_shot_hash(
    prompt: list[int], steps: list[list[int]], scheme_name: str
) -> None:
    scheme = KeyScheme(scheme_name, C)
    items = [MMItem.of("img", 0, min(len(prompt), C + 3))] if prompt else []
    t = RequestTracker(prompt, items, scheme=scheme)
    for step in steps:
        t.append_generated(step)
        keys = t.chunk_hashes()
        assert keys == scheme.chunk_hashes(t.get_token_ids(), items)
    total = len(prompt) + sum(map(len, steps))
    assert len(t.chunk_hashes()) == total // C
    assert t.get_token_ids().tolist()[len(prompt) :] == [x for s in steps for x in s]
