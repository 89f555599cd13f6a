"""Engine adapters: duck-typed vLLM / SGLang / TensorRT-LLM requests → tracker keys.

The objects here are shaped like the engines' own request objects (no engine is imported).
For each engine, ``RequestTracker.from_request`` must produce exactly the keys of a tracker
built directly from the equivalent prompt, items and request-level keys; broken variants
(missing identity, positions that do not fit) must trip the bypass guard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace as NS
from typing import Any

import pytest

from kvatlas.keys import BypassGuard, KeyScheme, MMItem, RequestTracker, extract_request

SCHEME_NAMES = ("blake3", "blake3-x1")
C = 16
PAD = 151655
# text(20) | image 1 [20, 60) | text(12) | image 2 [72, 97) | text(31): 128 tokens, 8 chunks
PROMPT = (
    list(range(100, 120)) + [PAD] * 40 + list(range(300, 312)) + [PAD] * 25 + list(range(400, 431))
)
SPANS = [(20, 40), (72, 25)]
GENERATED = list(range(9000, 9000 + 21))


def reference(
    items: list[MMItem],
    scheme: KeyScheme,
    request_keys: dict[str, str | int] | None = None,
    cache_salt: str = "",
    prompt: list[int] = PROMPT,
) -> RequestTracker:
    t = RequestTracker(
        prompt, items, scheme=scheme, request_keys=request_keys, cache_salt=cache_salt
    )
    t.append_generated(GENERATED)
    assert t.cacheable
    return t


def assert_same_keys(got: RequestTracker, want: RequestTracker) -> None:
    assert got.cacheable, got.uncacheable_reason
    assert got.get_token_ids().tolist() == want.get_token_ids().tolist()
    assert got.prompt_len == want.prompt_len
    assert got.chunk_hashes() == want.chunk_hashes()
    assert len(got.chunk_hashes()) == (len(PROMPT) + len(GENERATED)) // C
    assert got.prefix_keys("m", world_size=2) == want.prefix_keys("m", world_size=2)


# ------------------------------------------------------------------------------ request shapes


@dataclass
class PlaceholderRange:  # vllm.multimodal.inputs.PlaceholderRange
    offset: int
    length: int
    is_embed: Any = None


@dataclass
class MultiModalFeatureSpec:  # vllm.multimodal.inputs.MultiModalFeatureSpec
    identifier: Any
    mm_position: Any
    modality: str = "image"
    data: Any = None


@dataclass
class LoRARequest:  # vllm.lora.request.LoRARequest
    lora_name: str
    lora_int_id: int
    lora_path: str = "/adapters/x"


@dataclass
class VllmRequest:  # vllm.v1.request.Request (the fields the keys layer reads)
    request_id: str
    prompt_token_ids: Any
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)


def vllm_new(
    ids: list[Any] | None = None,
    spans: list[Any] | None = None,
    lora: str | None = None,
    salt: str | None = None,
) -> VllmRequest:
    ids = ["img-one", "img-two"] if ids is None else ids
    spans = SPANS if spans is None else spans
    return VllmRequest(
        request_id="vllm-1",
        prompt_token_ids=list(PROMPT),
        mm_features=[
            MultiModalFeatureSpec(i, PlaceholderRange(*s) if isinstance(s, tuple) else s)
            for i, s in zip(ids, spans, strict=True)
        ],
        lora_request=LoRARequest(lora, 3) if lora else None,
        cache_salt=salt,
        output_token_ids=list(GENERATED),
    )


def vllm_legacy(hashes: list[Any] | None = None, positions: list[Any] | None = None) -> NS:
    """Older vLLM: parallel ``mm_hashes`` / ``mm_positions`` (PlaceholderRange or dicts)."""
    return NS(
        request_id="vllm-legacy",
        prompt_token_ids=list(PROMPT),
        mm_hashes=["img-one", "img-two"] if hashes is None else hashes,
        mm_positions=(
            [PlaceholderRange(20, 40), {"offset": 72, "length": 25}]
            if positions is None
            else positions
        ),
        lora_request=None,
        cache_salt=None,
        output_token_ids=list(GENERATED),
    )


def sglang(items: list[tuple[Any, Any]] | None = None, lora_id: str | None = None) -> NS:
    """SGLang ``Req``: ``mm_items[i].hash`` (int) with inclusive ``(start, end)`` offsets."""
    items = [(0xABCDEF0123, [(20, 59)]), (0x77, [(72, 96)])] if items is None else items
    return NS(
        rid="sgl-1",
        origin_input_ids=list(PROMPT),
        output_ids=list(GENERATED),
        multimodal_inputs=NS(mm_items=[NS(hash=h, offsets=o, modality="image") for h, o in items]),
        lora_id=lora_id,
    )


WORDS_1 = [-1, 0x7FFFFFFF, -2147483648, 0, 12345, -12345, 1, 2]
WORDS_2 = [5, 6, 7, 8, 9, 10, 11, 12]


def words_hex(words: list[int]) -> str:
    return "".join(f"{w & 0xFFFFFFFF:08x}" for w in words)


def trtllm(
    hashes: list[Any] | None = None,
    positions: list[int] | None = None,
    lengths: list[int] | None = None,
    lora_task_id: int | None = None,
) -> NS:
    """TensorRT-LLM ``LlmRequest``: 256-bit hashes as eight int32 words (possibly negative)."""
    return NS(
        request_id=17,
        prompt_token_ids=list(PROMPT),
        output_token_ids=list(GENERATED),
        multimodal_hashes=[WORDS_1, WORDS_2] if hashes is None else hashes,
        multimodal_positions=[20, 72] if positions is None else positions,
        multimodal_lengths=[40, 25] if lengths is None else lengths,
        lora_task_id=lora_task_id,
    )


def items_of(ids: list[Any]) -> list[MMItem]:
    return [MMItem.of(i, off, n) for i, (off, n) in zip(ids, SPANS, strict=True)]


# ------------------------------------------------------------------------ equivalence per engine


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_vllm_new_style_matches_direct_tracker(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    guard = BypassGuard()
    got = RequestTracker.from_request(vllm_new(salt="tenant-a"), scheme=scheme, guard=guard)
    want = reference(items_of(["img-one", "img-two"]), scheme, cache_salt="tenant-a")
    assert_same_keys(got, want)
    assert got.cache_salt == "tenant-a" and got.request_id == "vllm-1"
    assert {k.cache_salt for k in got.prefix_keys("m")} == {"tenant-a"}
    other = RequestTracker.from_request(vllm_new(["img-one", "img-3"]), scheme=scheme)
    assert other.chunk_hashes()[:4] == got.chunk_hashes()[:4]  # up to image 2
    assert all(
        x != y for x, y in zip(other.chunk_hashes()[4:], got.chunk_hashes()[4:], strict=True)
    )
    assert guard.count == 0


def test_vllm_lora_under_x1_is_keyed_by_adapter_name() -> None:
    x1 = KeyScheme("blake3-x1", C)
    a = RequestTracker.from_request(vllm_new(lora="sql-adapter"), scheme=x1)
    want = reference(items_of(["img-one", "img-two"]), x1, request_keys={"lora": "sql-adapter"})
    assert_same_keys(a, want)
    b = RequestTracker.from_request(vllm_new(lora="chat-adapter"), scheme=x1)
    none = RequestTracker.from_request(vllm_new(), scheme=x1)
    for other in (b, none):
        assert all(x != y for x, y in zip(a.chunk_hashes(), other.chunk_hashes(), strict=True))
    again = RequestTracker.from_request(vllm_new(lora="sql-adapter"), scheme=x1)
    assert again.chunk_hashes() == a.chunk_hashes()


def test_vllm_lora_under_blake3_is_uncacheable(caplog: pytest.LogCaptureFixture) -> None:
    guard = BypassGuard()
    with caplog.at_level(logging.WARNING):
        t = RequestTracker.from_request(
            vllm_new(lora="sql-adapter"), scheme=KeyScheme("blake3", C), guard=guard
        )
    assert not t.cacheable
    assert t.chunk_hashes() == [] and t.prefix_keys("m") == []
    assert guard.count == 1
    assert "vllm-1" in caplog.text


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_vllm_legacy_matches_direct_tracker(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    guard = BypassGuard()
    got = RequestTracker.from_request(vllm_legacy(), scheme=scheme, guard=guard)
    assert_same_keys(got, reference(items_of(["img-one", "img-two"]), scheme))
    # Legacy and new style describe the same request: the same keys.
    assert (
        got.chunk_hashes() == RequestTracker.from_request(vllm_new(), scheme=scheme).chunk_hashes()
    )
    dicts = vllm_legacy(positions=[{"offset": 20, "length": 40}, {"offset": 72, "length": 25}])
    assert RequestTracker.from_request(dicts, scheme=scheme).chunk_hashes() == got.chunk_hashes()
    assert guard.count == 0


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_sglang_matches_direct_tracker(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    guard = BypassGuard()
    got = RequestTracker.from_request(sglang(), scheme=scheme, guard=guard)
    assert_same_keys(got, reference(items_of([0xABCDEF0123, 0x77]), scheme))
    assert got.request_id == "sgl-1"
    assert guard.count == 0


def test_sglang_item_with_several_ranges_keys_each_range_apart() -> None:
    """One item may carry several images under one hash: the ranges must not share values."""
    scheme = KeyScheme("blake3", C)
    req = sglang([(0xFEED, [(20, 59), (72, 96)])])
    t = RequestTracker.from_request(req, scheme=scheme)
    assert t.cacheable
    tokens = t.get_token_ids()
    assert PAD not in tokens[20:60].tolist() and PAD not in tokens[72:97].tolist()
    assert tokens[20:45].tolist() != tokens[72:97].tolist()
    other = RequestTracker.from_request(sglang([(0xBEEF, [(20, 59), (72, 96)])]), scheme=scheme)
    assert all(x != y for x, y in zip(other.chunk_hashes()[1:], t.chunk_hashes()[1:], strict=True))


def test_sglang_lora_under_x1() -> None:
    x1 = KeyScheme("blake3-x1", C)
    a = RequestTracker.from_request(sglang(lora_id="lora-a"), scheme=x1)
    assert_same_keys(a, reference(items_of([0xABCDEF0123, 0x77]), x1, {"lora": "lora-a"}))
    b = RequestTracker.from_request(sglang(lora_id="lora-b"), scheme=x1)
    assert all(x != y for x, y in zip(a.chunk_hashes(), b.chunk_hashes(), strict=True))


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_trtllm_matches_direct_tracker(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    guard = BypassGuard()
    got = RequestTracker.from_request(trtllm(), scheme=scheme, guard=guard)
    assert_same_keys(got, reference(items_of([words_hex(WORDS_1), words_hex(WORDS_2)]), scheme))
    assert got.request_id == "17"
    # Negative int32 words are the same 256-bit hash as their unsigned form.
    unsigned = trtllm(hashes=[[w & 0xFFFFFFFF for w in WORDS_1], WORDS_2])
    assert RequestTracker.from_request(unsigned, scheme=scheme).chunk_hashes() == got.chunk_hashes()
    # Hashes differing in one word only (the last) are different images.
    flipped = trtllm(hashes=[[*WORDS_1[:7], WORDS_1[7] + 1], WORDS_2])
    flipped_keys = RequestTracker.from_request(flipped, scheme=scheme).chunk_hashes()
    assert flipped_keys[0] == got.chunk_hashes()[0]
    assert all(x != y for x, y in zip(flipped_keys[1:], got.chunk_hashes()[1:], strict=True))
    assert guard.count == 0


def test_trtllm_lora_task_id_under_x1() -> None:
    x1 = KeyScheme("blake3-x1", C)
    a = RequestTracker.from_request(trtllm(lora_task_id=1), scheme=x1)
    want = reference(
        items_of([words_hex(WORDS_1), words_hex(WORDS_2)]), x1, request_keys={"lora": 1}
    )
    assert_same_keys(a, want)
    b = RequestTracker.from_request(trtllm(lora_task_id=2), scheme=x1)
    assert all(x != y for x, y in zip(a.chunk_hashes(), b.chunk_hashes(), strict=True))


def test_trtllm_text_only_request_keeps_its_lora() -> None:
    """A text-only TensorRT-LLM request (no multimodal fields set) still carries
    ``lora_task_id``: engine auto-detection must not drop it (keys would cross adapters)."""
    x1 = KeyScheme("blake3-x1", C)

    def text_only(lora_task_id: int) -> NS:
        return NS(
            request_id=1,
            prompt_token_ids=list(range(4 * C)),
            output_token_ids=[],
            multimodal_hashes=None,
            multimodal_positions=None,
            multimodal_lengths=None,
            lora_task_id=lora_task_id,
        )

    explicit = [
        RequestTracker.from_request(text_only(k), scheme=x1, engine="trtllm").chunk_hashes()
        for k in (1, 2)
    ]
    assert explicit[0] != explicit[1]
    detected = [RequestTracker.from_request(text_only(k), scheme=x1).chunk_hashes() for k in (1, 2)]
    assert detected == explicit


@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_text_only_requests_from_every_engine_agree(scheme_name: str) -> None:
    scheme = KeyScheme(scheme_name, C)
    prompt = list(range(50, 50 + 5 * C + 3))
    reqs = [
        VllmRequest("v", list(prompt)),
        NS(rid="s", origin_input_ids=list(prompt), output_ids=[], multimodal_inputs=None),
        NS(request_id=1, prompt_token_ids=list(prompt), multimodal_hashes=[], lora_task_id=None),
    ]
    want = RequestTracker(prompt, scheme=scheme).chunk_hashes()
    assert len(want) == 5
    for req in reqs:
        t = RequestTracker.from_request(req, scheme=scheme)
        assert t.cacheable and t.chunk_hashes() == want


def test_explicit_engine_and_unknown_engine() -> None:
    assert extract_request(trtllm(), "trtllm").items == items_of(
        [words_hex(WORDS_1), words_hex(WORDS_2)]
    )
    assert extract_request(sglang()).items == items_of([0xABCDEF0123, 0x77])
    with pytest.raises(ValueError, match="unknown engine"):
        extract_request(vllm_new(), "llama.cpp")


# -------------------------------------------------------------------------- broken variants


BROKEN: dict[str, Any] = {
    # vLLM, new style
    "vllm-identifier-none": lambda: vllm_new(ids=[None, "img-two"]),
    "vllm-identifier-empty": lambda: vllm_new(ids=["img-one", ""]),
    "vllm-position-none": lambda: vllm_new(spans=[(20, 40), None]),
    "vllm-position-garbage": lambda: vllm_new(spans=[(20, 40), "72:25"]),
    "vllm-negative-offset": lambda: vllm_new(spans=[(-4, 40), (72, 25)]),
    "vllm-span-past-prompt": lambda: vllm_new(spans=[(20, 40), (120, 25)]),
    "vllm-span-starts-past-prompt": lambda: vllm_new(spans=[(20, 40), (500, 4)]),
    "vllm-overlapping": lambda: vllm_new(spans=[(20, 40), (50, 25)]),
    "vllm-empty-span": lambda: vllm_new(spans=[(20, 40), (72, 0)]),
    "vllm-empty-span-at-prompt-end": lambda: vllm_new(spans=[(20, 40), (128, 0)]),
    "vllm-no-prompt-ids": lambda: VllmRequest(
        "v", None, [MultiModalFeatureSpec("img", PlaceholderRange(0, 4))]
    ),
    # vLLM, legacy
    "legacy-hashes-without-positions": lambda: vllm_legacy(positions=[]),
    "legacy-more-hashes-than-positions": lambda: vllm_legacy(
        hashes=["a", "b", "c"], positions=[PlaceholderRange(20, 40), PlaceholderRange(72, 25)]
    ),
    "legacy-positions-without-hashes": lambda: vllm_legacy(hashes=[]),
    "legacy-none-hash": lambda: vllm_legacy(hashes=["img-one", None]),
    "legacy-dict-missing-length": lambda: vllm_legacy(
        positions=[PlaceholderRange(20, 40), {"offset": 72}]
    ),
    "legacy-span-past-prompt": lambda: vllm_legacy(
        positions=[PlaceholderRange(20, 40), {"offset": 110, "length": 25}]
    ),
    "legacy-empty-span": lambda: vllm_legacy(
        positions=[PlaceholderRange(20, 40), {"offset": 72, "length": 0}]
    ),
    "legacy-span-beyond-prompt": lambda: vllm_legacy(
        positions=[PlaceholderRange(20, 40), PlaceholderRange(300, 2)]
    ),
    # SGLang
    "sglang-none-hash": lambda: sglang([(None, [(20, 59)])]),
    "sglang-no-offsets": lambda: sglang([(0x11, [(20, 59)]), (0x22, [])]),
    "sglang-offsets-none": lambda: sglang([(0x11, None)]),
    "sglang-bad-pair": lambda: sglang([(0x11, [(20,)])]),
    "sglang-reversed-pair": lambda: sglang([(0x11, [(59, 20)])]),
    "sglang-past-prompt": lambda: sglang([(0x11, [(100, 140)])]),
    "sglang-beyond-prompt": lambda: sglang([(0x11, [(200, 210)])]),
    "sglang-empty-range": lambda: sglang([(0x11, [(20, 59)]), (0x22, [(72, 71)])]),
    "sglang-empty-range-of-several": lambda: sglang([(0x11, [(20, 59), (72, 71)])]),
    "sglang-overlapping": lambda: sglang([(0x11, [(20, 59)]), (0x22, [(50, 70)])]),
    # TensorRT-LLM
    "trtllm-seven-words": lambda: trtllm(hashes=[WORDS_1[:7], WORDS_2]),
    "trtllm-none-hash": lambda: trtllm(hashes=[None, WORDS_2]),
    "trtllm-hashes-without-positions": lambda: trtllm(positions=[], lengths=[]),
    "trtllm-missing-length": lambda: trtllm(lengths=[40]),
    "trtllm-past-prompt": lambda: trtllm(positions=[20, 110]),
    "trtllm-overlapping": lambda: trtllm(positions=[20, 50]),
    "trtllm-empty-span": lambda: trtllm(lengths=[40, 0]),
    "trtllm-beyond-prompt": lambda: trtllm(positions=[20, 400]),
    "trtllm-garbage-word": lambda: trtllm(hashes=[["x"] * 8, WORDS_2]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_broken_requests_trip_the_bypass_guard(
    case: str, scheme_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    guard = BypassGuard()
    with caplog.at_level(logging.WARNING):
        t = RequestTracker.from_request(
            BROKEN[case](), scheme=KeyScheme(scheme_name, C), guard=guard
        )
    assert t.cacheable is False, f"{case} was keyed"
    assert t.chunk_hashes() == []
    assert t.prefix_keys("m") == [] and t.prefix_keys("m", world_size=2) == []
    assert guard.count == 1
    assert "uncacheable" in caplog.text


EMPTY_SPAN_REQUESTS: dict[str, Any] = {
    "vllm": lambda ident: vllm_new(ids=["img-one", ident], spans=[(20, 40), (72, 0)]),
    "vllm-legacy": lambda ident: vllm_legacy(
        hashes=["img-one", ident], positions=[PlaceholderRange(20, 40), PlaceholderRange(72, 0)]
    ),
    "sglang": lambda ident: sglang([(0x11, [(20, 59)]), (ident, [(72, 71)])]),
    "trtllm": lambda ident: trtllm(
        hashes=[WORDS_1, [ident] * 8], positions=[20, 72], lengths=[40, 0]
    ),
}


@pytest.mark.parametrize("engine", sorted(EMPTY_SPAN_REQUESTS))
@pytest.mark.parametrize("scheme_name", SCHEME_NAMES)
def test_empty_span_items_from_every_engine_are_refused_and_counted(
    engine: str, scheme_name: str
) -> None:
    """Two requests differing only in an item whose span is empty must not share keys: both
    are refused, and the guard counts them under one reason."""
    guard = BypassGuard()
    scheme = KeyScheme(scheme_name, C)
    first, second = (
        RequestTracker.from_request(EMPTY_SPAN_REQUESTS[engine](ident), scheme=scheme, guard=guard)
        for ident in (1, 2)
    )
    assert not first.cacheable and not second.cacheable
    assert first.chunk_hashes() == second.chunk_hashes() == []
    assert guard.reasons == {"empty placeholder span": 2}


def test_every_broken_request_is_counted_under_a_stable_reason() -> None:
    """The guard's counter is keyed by reason kind: no item index, offset or identifier in it,
    so the metric stays a small fixed set however many requests are refused."""
    guard = BypassGuard()
    for make in BROKEN.values():
        RequestTracker.from_request(make(), scheme=KeyScheme("blake3-x1", C), guard=guard)
    assert guard.count == len(BROKEN)
    assert set(guard.reasons) <= {
        "empty identifier",
        "missing identifier",
        "unusable placeholder position",
        "empty placeholder span",
        "placeholder span outside the prompt",
        "overlapping placeholder spans",
        "no prompt token ids",
        "request keys need blake3-x1",
    }, guard.reasons
