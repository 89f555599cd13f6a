"""BlendNamespace: the scope within which a stored chunk may be served to a requester; and
BlendMatch, what a fragment lookup finds in it.

Another model's KV is not interchangeable, another tenant's salt is isolated by design and
another parallel layout shards heads differently, so a fragment match is only ever served
inside the namespace that stored it. ``object_group_id`` is deliberately not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvatlas.checks import is_plain_int
from kvatlas.keys.object_key import ObjectKey, check_cache_salt, check_model_name


@dataclass(frozen=True, slots=True)
class BlendNamespace:
    model_name: str
    cache_salt: str = ""
    world_size: int = 1

    def __post_init__(self) -> None:
        check_model_name(self.model_name)
        check_cache_salt(self.cache_salt)
        ws = self.world_size
        if not is_plain_int(ws) or not 1 <= ws <= 255:
            raise ValueError(f"world_size must be an integer in [1, 255], got {ws!r}")

    @classmethod
    def from_object_key(cls, key: ObjectKey) -> BlendNamespace:
        return cls(key.model_name, key.cache_salt, key.world_size)


@dataclass(frozen=True, slots=True)
class BlendMatch:
    """A cached chunk found in a query: re-RoPE its KV from ``old_st`` to ``cur_st``."""

    chunk_hash: bytes
    old_st: int
    cur_st: int
