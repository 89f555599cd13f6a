import numpy as np
import pytest

from kvatlas.errors import Unprocessable
from kvatlas.events import CacheEntry, EventBatch, EventDecodeError, EventValidationError
from kvatlas.keys import ObjectKey
from kvatlas.web import error_payload

KEY = ObjectKey(bytes(32), "m", 1 << 24 | 1 << 8)


def batch(**kw: object) -> EventBatch:
    base: dict[str, object] = dict(
        instance_id="i", incarnation=1, seq=1, event_type="store", tier="l1", backend="dram"
    )
    base.update(kw)
    return EventBatch(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"instance_id": ""}, "instance_id"),
        ({"incarnation": -1}, "incarnation"),
        ({"incarnation": 1 << 64}, "incarnation"),
        ({"seq": 0}, "seq"),
        ({"seq": True}, "seq"),
        ({"event_type": "evict"}, "event_type"),
        ({"tier": "l3"}, "tier"),
        ({"backend": ""}, "backend"),
        ({"event_type": "delete", "backend": ""}, "backend"),
        ({"ts": float("nan")}, "ts"),
        ({"shared": 1}, "shared"),
        ({"event_type": "config"}, "capacity_bytes"),
        ({"event_type": "config", "capacity_bytes": 1}, "capacity_revision"),
        ({"event_type": "config", "capacity_bytes": -1, "capacity_revision": 0}, "capacity_bytes"),
        ({"capacity_bytes": 5, "capacity_revision": 0}, "capacity_bytes"),
        (
            {
                "event_type": "config",
                "capacity_bytes": 1,
                "capacity_revision": 1,
                "entries": (CacheEntry(KEY),),
            },
            "entries",
        ),
    ],
)
def test_batch_rejects_naming_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(EventValidationError) as info:
        batch(**kw)
    assert info.value.field == field


def test_access_and_config_need_no_backend() -> None:
    assert batch(event_type="access", backend="").backend == ""
    cfg = batch(event_type="config", backend="", capacity_bytes=10, capacity_revision=0)
    assert cfg.capacity_bytes == 10


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"size_bytes": -1}, "size_bytes"),
        ({"token_offset": -2}, "token_offset"),
        ({"token_ids": [1, -1]}, "token_ids"),
        ({"token_ids": [1 << 32]}, "token_ids"),
        ({"token_ids": [[1, 2]]}, "token_ids"),
    ],
)
def test_entry_rejects_naming_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(EventValidationError) as info:
        CacheEntry(KEY, **kw)  # type: ignore[arg-type]
    assert info.value.field == field


def test_tokens_are_readonly_uint32_and_never_alias_the_caller() -> None:
    mine = np.arange(4, dtype=np.uint32)
    entry = CacheEntry(KEY, 1, mine, 0)
    assert entry.token_ids is not None
    assert entry.token_ids.dtype == np.uint32 and not entry.token_ids.flags.writeable
    mine[0] = 99
    assert entry.token_ids[0] == 0
    from_list = CacheEntry(KEY, 1, [1, 2, 3], 0).token_ids
    assert from_list is not None and from_list.tolist() == [1, 2, 3]
    assert CacheEntry(KEY, 1, [], 0).token_ids is None
    assert CacheEntry(KEY).token_offset == -1


def test_entry_equality_compares_tokens() -> None:
    assert CacheEntry(KEY, 1, [1, 2], 0) == CacheEntry(KEY, 1, np.array([1, 2]), 0)
    assert CacheEntry(KEY, 1, [1, 2], 0) != CacheEntry(KEY, 1, [1, 3], 0)
    assert CacheEntry(KEY, 1, None, 0) != CacheEntry(KEY, 1, [1], 0)


def test_event_errors_are_unprocessable_and_carry_the_field() -> None:
    """422 with ``field`` beside ``detail``: what the coordinator replies for a bad batch."""
    with pytest.raises(EventValidationError) as info:
        batch(seq=0)
    exc = info.value
    assert isinstance(exc, Unprocessable) and isinstance(exc, ValueError)
    assert exc.status == 422
    assert error_payload(exc) == {"detail": str(exc), "field": "seq"}
    moved = exc.under("batches[3]")
    assert (moved.field, moved.reason) == ("batches[3].seq", exc.reason)
    assert error_payload(moved)["field"] == "batches[3].seq"
    decode_error = EventDecodeError("body", "not msgpack")
    assert isinstance(decode_error, EventValidationError) and decode_error.status == 422
