"""Pins, quotas and commands in the coordinator's snapshot: one section of the snapshot file
(``save_snapshot(..., sections={SECTION: encode_state(control)})``; restored with
:func:`restore_state` from ``SnapshotInfo.sections``), so a restarted coordinator keeps every
pin, every quota and every command that had not finished (what was ``sent`` is delivered
again: :meth:`CommandLog.from_snapshot`); the changes since are in the journal
(:mod:`.journal`), whose generation the section names. Versioned: a section this code does
not know is refused, never half-read.

With the state shared in Redis (``CacheControl.store``), Redis wins: the section is a copy,
written with every snapshot, that seeds Redis only if Redis holds no cache-control state when
the replica first reaches it (:class:`~.shared_store.SharedStore`), or later should Redis lose
its data (:meth:`~.shared_store.SharedStore.watch`: the last copy read from Redis while it
held the state); otherwise it is ignored."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import msgspec

from kvatlas.api.cache_control import EncodedKey
from kvatlas.coordinator.cache_control.commands import CommandLog
from kvatlas.coordinator.cache_control.pins import PinTable
from kvatlas.coordinator.cache_control.quotas import QuotaTable
from kvatlas.coordinator.cache_control.service import CacheControl, wire_key
from kvatlas.coordinator.cache_control.shared_commands import SharedCommandLog
from kvatlas.coordinator.cache_control.shared_tables import SharedPinTable
from kvatlas.errors import InvalidInput
from kvatlas.keys import ObjectKey, parse_chunk_hash_hex

log = logging.getLogger(__name__)
SECTION: Final = "cache_control"
_VERSION: Final = 1


class _State(msgspec.Struct):
    version: int
    pins: list[tuple[EncodedKey, int]]
    default_limit_gb: float | None
    limits: dict[str, float]
    commands: bytes  # CommandLog.to_snapshot
    journal_generation: int = 0
    """The journal generation replayed after it (0: a section written before journals, every
    one; -1: written without a journal, on the Redis transport, none)."""


def encode_state(control: CacheControl, journal_generation: int = 0) -> bytes:
    """The section; ``journal_generation``: the generation of :mod:`.journal` started before
    the state was read (a restore replays it and every later one; -1: none)."""
    return msgspec.msgpack.encode(
        _State(
            _VERSION,
            [(wire_key(k), n) for k, n in control.pins.rows()],
            control.quotas.default_limit_gb,
            control.quotas.limits(),
            control.commands.to_snapshot(),
            journal_generation,
        )
    )


def _decode(data: bytes) -> tuple[_State, list[tuple[ObjectKey, int]]]:
    state = msgspec.msgpack.decode(data, type=_State)
    if state.version != _VERSION:
        raise ValueError(f"cache-control section version {state.version} is not {_VERSION}")
    pins = [
        (ObjectKey(parse_chunk_hash_hex(k.chunk_hash_hex), k.model_name, k.kv_rank,
                   k.object_group_id, k.cache_salt), n)
        for k, n in state.pins if n > 0
    ]  # fmt: skip
    return state, pins


def restore_state(control: CacheControl, data: bytes, **command_options: object) -> int:
    """Replace ``control``'s pins, quotas and commands with the section's
    (:class:`~kvatlas.errors.InvalidInput` for a section that does not decode); returns the
    journal generation to replay from."""
    try:
        state, rows = _decode(data)
        pins = PinTable(rows)
        quotas = QuotaTable(state.default_limit_gb, state.limits)
        commands = CommandLog.from_snapshot(state.commands, **command_options)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise InvalidInput(f"cache-control snapshot section: {exc}") from None
    control.pins, control.quotas, control.commands = pins, quotas, commands
    return state.journal_generation


def seed_shared(control: CacheControl, data: bytes) -> None:
    """Write the section's pins, quotas and commands into the shared store of ``control``
    (called once, only when Redis holds none: :meth:`SharedStore.ensure`)."""
    if not isinstance(control.pins, SharedPinTable) or not isinstance(
        control.commands, SharedCommandLog
    ):
        raise TypeError("seed_shared needs the shared tables")
    try:
        state, rows = _decode(data)
    except (msgspec.MsgspecError, ValueError) as exc:
        log.error("cache-control snapshot section not seeded into Redis: %s", exc)
        return
    control.pins.seed(rows)
    control.quotas.set_default(state.default_limit_gb)
    for salt, gb in state.limits.items():
        control.quotas.set(salt, gb)
    control.commands.seed(state.commands)
    log.info(
        "seeded Redis with %d pins, %d quotas and the snapshot's commands",
        len(rows), len(state.limits),
    )  # fmt: skip


def seed_with(control: CacheControl, section: bytes) -> None:
    """Make ``section`` what the shared store of ``control`` seeds a Redis holding no
    cache-control state with (the one restored, then each one a snapshot read from Redis)."""
    if control.store is not None:
        control.store.seed = lambda: seed_shared(control, section)


def restore_section(
    control: CacheControl, sections: dict[str, bytes] | None, where: str | Path
) -> int:
    """Restore ``control`` from a snapshot's sections, if they hold one; a section that does
    not decode is logged and left out (the directory stays restored, cache control empty).
    Shared (Redis) state is not replaced: the section becomes the store's ``seed``. Returns
    the journal generation to replay from (0: every one)."""
    if sections is None or SECTION not in sections:
        return 0
    if control.store is not None:  # Redis wins: the section only seeds a Redis holding none
        seed_with(control, sections[SECTION])
        return 0
    try:
        return restore_state(control, sections[SECTION])
    except InvalidInput as exc:
        log.error("snapshot %s: cache control not restored (%s)", where, exc)
        return 0
