"""vLLM's KVEventBatch wire: every golden payload decodes to the meaning ``index.json`` gives it,
in all three encodings; the default encoding is vLLM's own, byte for byte; bad payloads raise a
counted kind, never a msgspec error (docs/kv-events.md). vLLM's own code: test_vllm_interop.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    VllmWireError,
    decode_batch,
    encode_batch,
    pack_seq,
    split_topic,
    unpack_seq,
)
from tests.kv_events.helpers import NESTED_TOO_DEEP, UNKNOWN_TAG_THEN_BAD_UTF8

GOLDEN = Path("/work/shared/wire/vllm-kv-events")
INDEX = json.loads((GOLDEN / "index.json").read_text())["cases"]
HASHES = [bytes.fromhex(h) for h in INDEX[0]["block_hashes_hex"]]
TOKENS = list(range(1000, 1064))


def meaning(case: dict[str, Any]) -> list[Any]:
    """The events ``index.json`` describes, as the structs the decoder must produce."""
    text = case["meaning"].removesuffix(" (vLLM's own structs)")
    if text.startswith(("two BlockStored", "as current-stored")):
        return [
            BlockStored(HASHES[:2], None, TOKENS[:32], 16, medium="GPU", group_idx=0,
                        kv_cache_spec_kind="full_attention"),
            BlockStored(HASHES[2:], HASHES[1], TOKENS[32:], 16, medium="CPU",
                        lora_name="adapter-a", extra_keys=[["img-hash-1"], None]),
        ]  # fmt: skip
    if text.startswith("BlockRemoved of block 3"):
        return [BlockRemoved([HASHES[3]], medium="GPU")]
    if text == "AllBlocksCleared":
        return [AllBlocksCleared()]
    assert text.startswith("BlockStored with 64-bit integer")
    return [BlockStored([123456789012345, -42], None, TOKENS[:32], 16, medium="GPU")]


@pytest.mark.parametrize("case", INDEX, ids=[c["file"] for c in INDEX])
def test_every_golden_payload_decodes_to_its_meaning(case: dict[str, Any]) -> None:
    batch = decode_batch((GOLDEN / case["file"]).read_bytes())
    want = meaning(case)
    assert len(batch.events) == len(want)
    for got, exp in zip(batch.events, want, strict=True):
        assert isinstance(got, type(exp))
        assert msgspec.structs.asdict(got) == msgspec.structs.asdict(exp)
    no_dp = "no dp rank" in case["meaning"]
    assert batch.data_parallel_rank == (None if no_dp else 0)
    assert split_topic(case["topic"]) == ("pod-a", "llama")


def test_current_and_legacy_encodings_decode_alike() -> None:
    pairs = [(c, c.replace("current", "legacy-array")) for c in
             ("current-stored", "current-removed", "current-cleared", "current-int-hashes")]  # fmt: skip
    for current, legacy in pairs:
        a = decode_batch((GOLDEN / f"{current}.msgpack").read_bytes())
        b = decode_batch((GOLDEN / f"{legacy}.msgpack").read_bytes())
        assert a.ts == b.ts and a.data_parallel_rank == b.data_parallel_rank
        assert [msgspec.structs.asdict(e) for e in a.events] == [
            msgspec.structs.asdict(e) for e in b.events
        ]


def test_unknown_trailing_fields_are_ignored_in_both_encodings() -> None:
    raw = msgspec.msgpack.decode((GOLDEN / "current-removed.msgpack").read_bytes())
    raw["future"] = 1
    raw["events"][0]["future_field"] = [1, 2]
    assert decode_batch(msgspec.msgpack.encode(raw)).events[0] == BlockRemoved([HASHES[3]], "GPU")
    legacy = msgspec.msgpack.decode((GOLDEN / "legacy-array-removed.msgpack").read_bytes())
    legacy[1][0] += ["future", 7]
    legacy.append("future")
    batch = decode_batch(msgspec.msgpack.encode(legacy))
    assert msgspec.structs.asdict(batch.events[0]) == msgspec.structs.asdict(
        BlockRemoved([HASHES[3]], "GPU")
    )


def test_the_default_encoding_is_vllms_a_plain_decoder_reads() -> None:
    """vLLM's layout: the batch an array ``[ts, events, dp]`` , each event
    a map tagged by ``type`` that always carries the fields vLLM declares without a default."""
    batch = KVEventBatch(
        1.5,
        [BlockStored(HASHES[:1], None, TOKENS[:16], 16, medium="kvatlas-l1"),
         BlockRemoved(HASHES[1:2], "kvatlas-l1"), AllBlocksCleared()],
    )  # fmt: skip
    payload = encode_batch(batch)
    plain = msgspec.msgpack.decode(payload)
    assert isinstance(plain, list) and plain[0] == 1.5 and plain[2] is None
    assert plain[1] == [
        {"type": "BlockStored", "block_hashes": HASHES[:1], "parent_block_hash": None,
         "token_ids": TOKENS[:16], "block_size": 16, "lora_id": None, "medium": "kvatlas-l1",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": HASHES[1:2], "medium": "kvatlas-l1"},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    assert decode_batch(payload) == batch
    assert msgspec.msgpack.decode(encode_batch(batch, "map"))["events"][2] == {
        "type": "AllBlocksCleared"
    }


def test_a_vllm_batch_with_array_events_is_the_older_layout() -> None:
    """A top-level array whose events are arrays decodes as the older layout, mixed never."""
    older = decode_batch(golden_bytes("legacy-array-stored"))
    assert older == decode_batch(golden_bytes("vllm-0.33.0-stored"))
    raw = msgspec.msgpack.decode(golden_bytes("vllm-0.33.0-removed"))
    raw[1].append(["BlockRemoved", [HASHES[0]], "GPU"])
    with pytest.raises(VllmWireError) as err:
        decode_batch(msgspec.msgpack.encode(raw))
    assert err.value.kind == "invalid"


def golden_bytes(name: str) -> bytes:
    return (GOLDEN / f"{name}.msgpack").read_bytes()


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),
        (b"\x92\x01", "malformed"),
        (msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockMoved"}]}), "unknown_event"),
        (msgspec.msgpack.encode([1.0, [["BlockMoved", [b"x"]]], None]), "unknown_event"),
        (msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockRemoved"}]}), "invalid"),
        (msgspec.msgpack.encode({"ts": "x", "events": []}), "invalid"),
        (msgspec.msgpack.encode(7), "invalid"),
        (msgspec.msgpack.encode({"ts": 1.0, "events": [], "data_parallel_rank": "x"}), "invalid"),
        pytest.param(UNKNOWN_TAG_THEN_BAD_UTF8, "malformed", id="unknown-tag-then-bad-utf8"),
        pytest.param(NESTED_TOO_DEEP, "malformed", id="nested-too-deep"),
    ],
)
def test_bad_payloads_raise_a_counted_kind(payload: bytes, kind: str) -> None:
    with pytest.raises(VllmWireError) as err:
        decode_batch(payload)
    assert err.value.kind == kind


def test_seq_frames() -> None:
    assert unpack_seq(pack_seq(7)) == 7
    assert unpack_seq(pack_seq(-1)) == -1
    assert pack_seq(1) == b"\x00" * 7 + b"\x01"
    with pytest.raises(VllmWireError) as err:
        unpack_seq(b"\x01")
    assert err.value.kind == "frames"


def test_topics() -> None:
    assert split_topic("kv@pod-a@llama") == ("pod-a", "llama")
    assert split_topic("kv@pod-a") == ("pod-a", None)
    assert split_topic("kv@pool:s3@m") == ("pool:s3", "m")


@pytest.mark.parametrize("case", INDEX, ids=[c["file"] for c in INDEX])
def test_the_encoder_reproduces_every_golden_payload(case: dict[str, Any]) -> None:
    """vLLM's and the older layout byte for byte: what kvatlas publishes is what vLLM would."""
    payload = (GOLDEN / case["file"]).read_bytes()
    encoding = {"legacy-array": "array", "current": "map"}.get(case["encoding"], "vllm")
    if encoding == "map":  # no vLLM wrote these: the meaning survives, the bytes need not
        assert decode_batch(encode_batch(decode_batch(payload), "map")) == decode_batch(payload)
    else:
        assert encode_batch(decode_batch(payload), encoding) == payload


def test_any_encoding_of_a_decoded_batch_is_that_encoding() -> None:
    stored = ("current-stored", "legacy-array-stored", "vllm-0.33.0-stored")
    for name in stored:
        batch = decode_batch(golden_bytes(name))
        assert isinstance(msgspec.msgpack.decode(encode_batch(batch, "map"))["events"][0], dict)
        assert encode_batch(batch, "array") == golden_bytes("legacy-array-stored")
        assert encode_batch(batch) == golden_bytes("vllm-0.33.0-stored")
    with pytest.raises(ValueError, match="encoding"):
        encode_batch(batch, "yaml")
