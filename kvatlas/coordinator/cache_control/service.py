"""The coordinator's cache-control operations below HTTP (``docs/cache-control.md``): what each
route does, as functions of typed bodies that return typed replies or raise from :mod:`kvatlas.errors` (422 a body, 400 a key field, 404 an unknown instance or
quota). A route handler decodes the body, calls one of these and encodes the reply.

Keys are resolved with the coordinator's own hashing (complete chunks, one key per rank).
Deletes and prefetches become durable commands (:mod:`.commands`) that the delivery loop sends
to the instance; the reply says what was asked (``requested`` chunks, ``affected`` keys sent,
``skipped`` pinned ones), while the command carries it to completion. A delete whose every
key is pinned (without ``force``) sends nothing and records nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from kvatlas.api.cache_control import (
    MAX_PIN_PAGE,
    CoordinatorDeleteBody,
    CoordinatorDeleteReply,
    CoordinatorPrefetchBody,
    CoordinatorPrefetchReply,
    CoordinatorPrefetchStatus,
    EncodedKey,
    MoveBody,
    MoveReply,
    MoveStatus,
    PinReply,
    PinRow,
    PinsReply,
    QuotaConfig,
    QuotaList,
    QuotaSetBody,
    QuotaSetReply,
    QuotaStatus,
    TokenFields,
    check_token_count,
)
from kvatlas.coordinator.cache_control.commands import Command, CommandLog
from kvatlas.coordinator.cache_control.pins import Pins, PinTable
from kvatlas.coordinator.cache_control.quotas import GB, Quotas, QuotaTable, salt_of_path
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.errors import Conflict, InvalidInput, NotFound, Unprocessable
from kvatlas.keys import (
    ObjectKey,
    check_cache_salt,
    check_wire_model_name,
    chunk_hashes,
    expand_prefix_keys,
)

_UNKNOWN: Final = "no MP server registered with instance_id={!r}"


def wire_key(key: ObjectKey) -> EncodedKey:
    return EncodedKey(
        key.chunk_hash.hex(), key.model_name, key.kv_rank, key.object_group_id, key.cache_salt
    )


@dataclass(frozen=True)
class Resolved:
    """A request's keys: ``chunks`` complete chunks, ``keys`` one per chunk and rank."""

    chunks: int
    keys: list[ObjectKey]


@dataclass(frozen=True)
class DeleteOutcome:
    """The reply, and the command that carries the delete out (``None``: nothing to send)."""

    reply: CoordinatorDeleteReply
    command: Command | None


@dataclass(frozen=True)
class PrefetchOutcome:
    reply: CoordinatorPrefetchReply
    command: Command | None


class CacheControl:
    """Pins, quotas and commands of one coordinator (all three are in its snapshot), or of
    every replica of a fleet (``store``: kept in Redis, :mod:`.shared_store`)."""

    def __init__(
        self,
        chunk_size: int,
        *,
        is_instance: Callable[[str], bool],
        usage_by_salt: Callable[[], Mapping[str, int]],
        hash_chunks: Callable[[list[int]], list[bytes]] | None = None,
        pins: Pins | None = None,
        quotas: Quotas | None = None,
        commands: CommandLog | None = None,
        store: SharedStore | None = None,
        may_hold: Callable[[str, str], bool] = lambda _instance_id, _salt: True,
    ) -> None:
        self.chunk_size = chunk_size
        self.is_instance = is_instance
        self.may_hold = may_hold
        """Whether an instance may store keys of a salt (its registering token's binding):
        one that may not is never asked to load them (its store events would be refused)."""
        self.usage_by_salt = usage_by_salt  # bytes of L2 copies per salt (the directory's)
        self.hash_chunks = hash_chunks or (lambda tokens: chunk_hashes(tokens, chunk_size))
        self.pins: Pins = pins or PinTable()
        self.quotas: Quotas = quotas or QuotaTable()
        self.commands = commands or CommandLog()
        self.store = store
        """Set when pins, quotas and commands are in Redis (every replica's), not in this
        process's memory (the tables above are then :mod:`.shared_tables`' and
        :mod:`.shared_commands`')."""

    # ------------------------------------------------------------------ keys

    def resolve(self, fields: TokenFields) -> Resolved:
        """The keys of ``fields``' complete chunks (400 a bad salt, model or token id, or
        more than 1,000,000 token ids; the salt is checked even when no chunk is complete)."""
        check_token_count(fields.token_ids)
        try:
            check_cache_salt(fields.cache_salt)
            check_wire_model_name(fields.model_name)
            hashes = self.hash_chunks(fields.token_ids)
            keys = expand_prefix_keys(
                hashes, fields.model_name, fields.world_size, fields.cache_salt
            )
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return Resolved(len(hashes), keys)

    # ------------------------------------------------------------------ pins

    def pin(self, fields: TokenFields) -> PinReply:
        found = self.resolve(fields)
        return PinReply(found.chunks, self.pins.pin(found.keys), "pinned")

    def unpin(self, fields: TokenFields) -> PinReply:
        found = self.resolve(fields)
        return PinReply(found.chunks, self.pins.unpin(found.keys), "unpinned")

    def list_pins(
        self, cache_salt: str | None, model_name: str | None, offset: int, limit: int
    ) -> PinsReply:
        """A page of pins, first pinned first; an empty ``cache_salt`` or ``model_name`` does
        not filter (LMCache's reading), ``_default`` lists the empty salt's."""
        if not 1 <= limit <= MAX_PIN_PAGE:
            raise Unprocessable(f"limit: Input should be between 1 and {MAX_PIN_PAGE}")
        if offset < 0:
            raise Unprocessable("offset: Input should be greater than or equal to 0")
        # LMCache lists every salt for an empty ``cache_salt``; ``_default`` names the empty one
        salt = None if not cache_salt else self._salt(cache_salt)
        total, rows = self.pins.page(salt, model_name or None, offset, limit)
        return PinsReply(total, [PinRow(wire_key(k), n) for k, n in rows])

    def node_pins(
        self, salts: frozenset[str] | None, model_name: str, offset: int, limit: int
    ) -> PinsReply:
        """A node's read of its pins: ``model_name``'s keys (every model when empty) in
        ``salts`` (``None``: every salt), first pinned first."""
        if not 1 <= limit <= MAX_PIN_PAGE:
            raise Unprocessable(f"limit: Input should be between 1 and {MAX_PIN_PAGE}")
        if offset < 0:
            raise Unprocessable("offset: Input should be greater than or equal to 0")
        total, rows = self.pins.page(None, model_name or None, offset, limit, salts=salts)
        return PinsReply(total, [PinRow(wire_key(k), n) for k, n in rows])

    # ------------------------------------------------------------------ delete, prefetch

    def delete(self, body: CoordinatorDeleteBody) -> DeleteOutcome:
        self._require_instance(body.instance_id)
        found = self.resolve(body)
        if not found.keys:
            return DeleteOutcome(CoordinatorDeleteReply(body.instance_id, 0, 0, 0, "noop"), None)
        held = set() if body.force else self.pins.pinned(found.keys)
        send = [k for k in found.keys if k not in held]
        command = None
        if send:
            command = self.commands.new(
                "delete", [body.instance_id], [wire_key(k) for k in send],
                tier=body.tier, force=body.force,
            )  # fmt: skip
        reply = CoordinatorDeleteReply(
            body.instance_id, found.chunks, len(send), len(found.keys) - len(send), "deleted"
        )
        return DeleteOutcome(reply, command)

    def prefetch(self, body: CoordinatorPrefetchBody) -> PrefetchOutcome:
        self._require_instance(body.instance_id)
        self._require_holder(body.instance_id, body.cache_salt)
        found = self.resolve(body)
        if not found.keys:
            return PrefetchOutcome(CoordinatorPrefetchReply(body.instance_id, "", 0, "noop"), None)
        command = self.commands.new(
            "prefetch", [body.instance_id], [wire_key(k) for k in found.keys], tier="l2",
            token_ids=tuple(body.token_ids[: found.chunks * self.chunk_size]),
            world_size=body.world_size,
        )  # fmt: skip
        reply = CoordinatorPrefetchReply(
            body.instance_id, command.command_id, found.chunks, "submitted"
        )
        return PrefetchOutcome(reply, command)

    def prefetch_status(
        self, instance_id: str, request_id: str
    ) -> CoordinatorPrefetchStatus | None:
        """A prefetch this coordinator recorded, or ``None``: not one of its commands (one
        submitted on the instance itself), so the route asks the instance (LMCache's
        coordinator always does: 502 when the instance does not answer). A recorded prefetch
        is answered even while its instance is not registered here (with the Redis transport
        another replica may have recorded it for an instance registered with that one)."""
        command = self.commands.get(request_id)
        if command is None or command.kind != "prefetch" or instance_id not in command.targets:
            self._require_instance(instance_id)
            return None
        if command.state != "completed":
            return CoordinatorPrefetchStatus("pending")
        found = command.found_keys if command.found_keys is not None else 0
        return CoordinatorPrefetchStatus(
            "completed", found_keys=found, total_keys=len(command.keys)
        )

    def move(self, body: MoveBody) -> tuple[MoveReply, Command | None]:
        """Validate a move and record it; the delivery loop carries it out (:mod:`.moves`:
        load and hold on the target, then delete the source's L1 copies)."""
        source, target = body.source_instance_id, body.target_instance_id
        if source == target:
            raise InvalidInput(f"source and target are the same instance ({source!r})")
        self._require_instance(source)
        self._require_instance(target)
        self._require_holder(target, body.cache_salt)
        found = self.resolve(body)
        if not found.keys:
            return MoveReply("", source, target, 0, "noop"), None
        command = self.commands.new(
            "move", [target], [wire_key(k) for k in found.keys], tier="l1", source=source,
            keep_source=body.keep_source,
            token_ids=tuple(body.token_ids[: found.chunks * self.chunk_size]),
            world_size=body.world_size,
        )  # fmt: skip
        return MoveReply(command.command_id, source, target, found.chunks, "pending"), command

    def move_status(self, move_id: str) -> MoveStatus:
        """A recorded move (404 an id that is not one; kept ``retention_s`` after it ends).
        ``error``: why it failed, or while pending why its last attempt stopped."""
        c = self.commands.get(move_id)
        if c is None or c.kind != "move":
            raise NotFound(f"unknown move_id={move_id!r}")
        status: Literal["pending", "completed", "failed"] = (
            "pending" if c.state in ("pending", "sent") else c.state  # type: ignore[assignment]
        )
        return MoveStatus(
            c.command_id, c.source, c.targets[0], status, c.phase,
            len(c.keys) // max(c.world_size, 1), c.found_keys or 0, c.missing, c.deleted,
            c.skipped, c.last_error or None,
        )  # fmt: skip

    def _require_instance(self, instance_id: str) -> None:
        if not self.is_instance(instance_id):
            raise NotFound(_UNKNOWN.format(instance_id))

    def _require_holder(self, instance_id: str, cache_salt: str) -> None:
        """409 unless ``instance_id`` may store keys of ``cache_salt``: keys loaded there
        (a prefetch, a move's target) would be store events its token may not send, refused
        whole, and its event reporting would stop at them (another tenant's node blinded)."""
        if not self.may_hold(instance_id, cache_salt):
            raise Conflict(
                f"instance {instance_id!r} does not serve cache_salt {cache_salt!r} (the token "
                "it registered with is bound to other salts): it cannot load its keys"
            )

    # ------------------------------------------------------------------ quotas

    def quota_config(self) -> QuotaConfig:
        return QuotaConfig(self.quotas.default_limit_gb)

    def set_quota_config(self, body: QuotaConfig) -> QuotaConfig:
        self.quotas.set_default(body.default_limit_gb)
        return QuotaConfig(body.default_limit_gb)

    def set_quota(self, salt_segment: str, body: QuotaSetBody) -> QuotaSetReply:
        salt = self._salt(salt_segment)
        self.quotas.set(salt, body.limit_gb)
        return QuotaSetReply(salt, body.limit_gb, "ok")

    def remove_quota(self, salt_segment: str) -> QuotaSetReply:
        """``removed``, or ``not_found`` (200, as LMCache answers: its CLI fails on a 404)."""
        salt = self._salt(salt_segment)
        return QuotaSetReply(salt, 0.0, "removed" if self.quotas.remove(salt) else "not_found")

    def quota(self, salt_segment: str) -> QuotaStatus:
        salt = self._salt(salt_segment)
        return self._status(salt, self.usage_by_salt().get(salt, 0))

    def quotas_listed(self) -> QuotaList:
        usage = self.usage_by_salt()
        salts = sorted(set(usage) | set(self.quotas.limits()))
        rows = [self._status(s, usage.get(s, 0)) for s in salts]
        return QuotaList(sum(usage.values()) / GB, rows)

    def _status(self, salt: str, used_bytes: int) -> QuotaStatus:
        own = self.quotas.own(salt)
        return QuotaStatus(salt, own if own is not None else 0.0, own is not None, used_bytes / GB)

    @staticmethod
    def _salt(segment: str) -> str:
        try:
            return salt_of_path(segment)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
