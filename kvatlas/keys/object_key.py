"""ObjectKey: whose KV a chunk is (content+prefix hash, model, parallel rank, group, tenant salt).

The field rules are the wire contract shared with LMCache MP servers: a model name never holds
``@`` and a salt never holds ``@ / \\ NUL`` because both are joined into storage paths and
string keys downstream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from kvatlas.checks import is_plain_int

MAX_SALT_CHARS = 128
MAX_MODEL_NAME_CHARS = 1024
"""The longest model name a request or an event may give (:func:`check_wire_model_name`): a
Hugging Face id (``meta-llama/Llama-3.1-8B-Instruct``) or a local path (a snapshot in a Hugging
Face cache is about 150 characters) fits many times over; a name of 100,000 characters would
be held in every key, listing and snapshot of it."""
MAX_INSTANCE_ID_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
_HEX = frozenset("0123456789abcdefABCDEF")
_MAX_CACHED_SHAPES = 4096
ShapeParts = tuple[str, int, int, str]
"""A key's fields but its hash: model name, kv rank, object group id, cache salt."""
shape_parts = attrgetter("model_name", "kv_rank", "object_group_id", "cache_salt")
"""The :data:`ShapeParts` of a key, or of any object with its fields (a wire entry)."""
chunk_hash_of = attrgetter("chunk_hash")
"""A key's chunk hash (or a wire entry's): for C-level maps over many."""
_VALID_SHAPES: set[ShapeParts] = set()


def _check_byte_field(name: str, value: int, lo: int, hi: int) -> None:
    if not is_plain_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def pack_kv_rank(world_size: int, global_rank: int, local_world_size: int, local_rank: int) -> int:
    """``world_size<<24 | global_rank<<16 | local_world_size<<8 | local_rank``, 8 bits each."""
    _check_byte_field("world_size", world_size, 1, 255)
    _check_byte_field("global_rank", global_rank, 0, world_size - 1)
    _check_byte_field("local_world_size", local_world_size, 1, 255)
    _check_byte_field("local_rank", local_rank, 0, local_world_size - 1)
    return world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank


def unpack_kv_rank(kv_rank: int) -> tuple[int, int, int, int]:
    """Inverse of :func:`pack_kv_rank`; validates the unpacked fields the same way."""
    if not is_plain_int(kv_rank) or not 0 <= kv_rank < 1 << 32:
        raise ValueError(f"kv_rank must be an unsigned 32-bit integer, got {kv_rank!r}")
    fields = (kv_rank >> 24, (kv_rank >> 16) & 0xFF, (kv_rank >> 8) & 0xFF, kv_rank & 0xFF)
    pack_kv_rank(*fields)
    return fields


def check_model_name(model_name: str) -> str:
    if not isinstance(model_name, str) or not model_name:
        raise ValueError("model_name must be a non-empty string")
    if "@" in model_name:
        raise ValueError(f"model_name must not contain '@': {model_name!r:.200}")
    return model_name


def check_wire_model_name(model_name: str) -> str:
    """A model name as a request, an event or a setting gives it: the key rule
    (:func:`check_model_name`) and at most :data:`MAX_MODEL_NAME_CHARS` characters. Checked
    where keys are parsed from the wire, not by :class:`ObjectKey` itself: keys already held (a
    snapshot or a journal written before the cap) are restored as they were, never dropped
    with the whole snapshot."""
    check_model_name(model_name)
    if len(model_name) > MAX_MODEL_NAME_CHARS:
        raise ValueError(
            f"model_name longer than {MAX_MODEL_NAME_CHARS} characters ({len(model_name)})"
        )
    return model_name


def _check_path_safe(field: str, value: str, max_chars: int) -> str:
    """The salt rule: a string of at most ``max_chars`` characters, none of ``@ / \\ NUL``."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ValueError(f"{field} longer than {max_chars} characters")
    bad = _SALT_FORBIDDEN.intersection(value)
    if bad:
        raise ValueError(f"{field} must not contain any of @ / \\ NUL (found {sorted(bad)!r})")
    return value


def check_cache_salt(cache_salt: str) -> str:
    return _check_path_safe("cache_salt", cache_salt, MAX_SALT_CHARS)


def check_instance_id(instance_id: str) -> str:
    """An instance id names a directory (``--l2-path/<id>``) and is joined into event topics
    (``kv@<id>@<model>``), so it follows the salt rule, is non-empty and is neither ``.`` nor
    ``..`` (``../escaped`` must never become a path outside the L2 root)."""
    _check_path_safe("instance_id", instance_id, MAX_INSTANCE_ID_CHARS)
    if instance_id in ("", ".", ".."):
        raise ValueError(f"instance_id must be a name other than '', . and .., got {instance_id!r}")
    return instance_id


def parse_chunk_hash_hex(text: str) -> bytes:
    """Decode a wire chunk hash: exactly 64 hex characters."""
    if not isinstance(text, str) or len(text) != 64 or not _HEX.issuperset(text):
        raise ValueError(f"chunk_hash_hex must be 64 hex characters, got {text!r:.80}")
    return bytes.fromhex(text)


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """Immutable, hashable identity of one stored KV object."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_hash, bytes) or len(self.chunk_hash) != 32:
            raise ValueError("chunk_hash must be 32 bytes")
        shape = (self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)
        # Millions of keys share a handful of shapes: validate each shape once (exact types
        # only, so True never passes for 1).
        if type(self.kv_rank) is int and type(self.object_group_id) is int:
            try:
                if shape in _VALID_SHAPES:
                    return
            except TypeError:  # unhashable field: the checks below say which
                pass
        check_model_name(self.model_name)
        unpack_kv_rank(self.kv_rank)
        if not is_plain_int(self.object_group_id) or not 0 <= self.object_group_id < 1 << 64:
            raise ValueError(
                f"object_group_id must be an integer in [0, 2^64), got {self.object_group_id!r}"
            )
        check_cache_salt(self.cache_salt)
        if type(self.kv_rank) is int and type(self.object_group_id) is int:
            if len(_VALID_SHAPES) >= _MAX_CACHED_SHAPES:
                _VALID_SHAPES.clear()
            _VALID_SHAPES.add(shape)

    @property
    def world_size(self) -> int:
        return self.kv_rank >> 24

    def to_wire(self) -> dict[str, Any]:
        return {
            "chunk_hash_hex": self.chunk_hash.hex(),
            "model_name": self.model_name,
            "kv_rank": self.kv_rank,
            "object_group_id": self.object_group_id,
            "cache_salt": self.cache_salt,
        }

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> ObjectKey:
        """Decode the JSON wire form; raises ``ValueError`` naming the offending field.

        Unknown fields are refused: one may carry identity we would otherwise drop, merging
        two different keys into one (wrong KV is worse than a rejected request).
        """
        if not isinstance(obj, Mapping):
            raise ValueError("key must be a JSON object")
        unknown = set(obj) - {
            "chunk_hash_hex",
            "model_name",
            "kv_rank",
            "object_group_id",
            "cache_salt",
        }
        if unknown:
            raise ValueError(f"key has unknown fields: {sorted(unknown)}")
        for field in ("chunk_hash_hex", "model_name", "kv_rank"):
            if field not in obj:
                raise ValueError(f"key is missing {field!r}")
        return cls(
            chunk_hash=parse_chunk_hash_hex(obj["chunk_hash_hex"]),
            model_name=obj["model_name"],
            kv_rank=obj["kv_rank"],
            object_group_id=obj.get("object_group_id", 0),
            cache_salt=obj.get("cache_salt", ""),
        )


_SHAPE_TYPES = (str, int, int, str)
_SET_FIELDS = tuple(
    ObjectKey.__dict__[f].__set__
    for f in ("chunk_hash", "model_name", "kv_rank", "object_group_id", "cache_salt")
)


def object_keys(hashes_hex: Sequence[str], parts: Sequence[ShapeParts]) -> list[ObjectKey]:
    """``ObjectKey(parse_chunk_hash_hex(h), *p)`` for each pair, in order: equal keys, and the
    same ``ValueError`` for the first key that breaks a rule. The hashes are parsed by one
    ``bytes.fromhex`` and each distinct shape checked once by building its first key; the
    others are then made without a check each (≈0.8 µs a key of a lookup's 128, a third of
    building each). Anything unusual (a hash not of 64 characters, not hex, with white space)
    takes the key-by-key path, which says what is wrong."""
    raw = _hex_hashes(hashes_hex)
    if raw is None:
        return [
            ObjectKey(parse_chunk_hash_hex(h), *p) for h, p in zip(hashes_hex, parts, strict=True)
        ]
    hashes = [raw[i : i + 32] for i in range(0, len(raw), 32)]
    seen: set[ShapeParts] = set()
    for h, p in zip(hashes, parts, strict=True):
        if tuple(map(type, p)) != _SHAPE_TYPES:  # (checked one by one)
            return [ObjectKey(h, *p) for h, p in zip(hashes, parts, strict=True)]
        if p not in seen:
            ObjectKey(h, *p)  # the checks a key of this shape passes, raising as it would
            seen.add(p)
    new, set_hash, set_model, set_rank, set_group, set_salt = object.__new__, *_SET_FIELDS
    keys = []
    for h, (model, rank, group, salt) in zip(hashes, parts, strict=True):
        k = new(ObjectKey)
        set_hash(k, h)
        set_model(k, model)
        set_rank(k, rank)
        set_group(k, group)
        set_salt(k, salt)
        keys.append(k)
    return keys


def _hex_hashes(texts: Sequence[str]) -> bytes | None:
    """The 32 bytes of each of ``texts`` back to back, if each is a ``str`` of 64 hex
    characters (``bytes.fromhex`` refuses any other character but white space, which would
    leave fewer than 32 bytes a text); else ``None``."""
    if set(map(type, texts)) - {str} or set(map(len, texts)) - {64}:
        return None
    try:
        raw = bytes.fromhex("".join(texts))
    except ValueError:
        return None
    return raw if len(raw) == 32 * len(texts) else None


def expand_prefix_keys(
    chunk_hashes: Iterable[bytes],
    model_name: str,
    world_size: int = 1,
    cache_salt: str = "",
    object_group_id: int = 0,
    local_world_size: int | None = None,
) -> list[ObjectKey]:
    """Expand chunk hashes to the ``world_size`` keys a prefix lookup asks for.

    Chunk-major, rank-minor: all ranks of chunk 0, then chunk 1, ... Ranks are laid out
    node-major (``local_rank = rank % local_world_size``); by default one node holds them all.
    """
    local = world_size if local_world_size is None else local_world_size
    ranks = [pack_kv_rank(world_size, r, local, r % local) for r in range(world_size)]
    return [
        ObjectKey(h, model_name, rank, object_group_id, cache_salt)
        for h in chunk_hashes
        for rank in ranks
    ]
