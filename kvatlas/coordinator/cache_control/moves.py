"""Moves L1 -> L1 between two nodes, carried out so that the fleet never holds zero copies of a
key, even when the coordinator is killed mid-move (``docs/cache-control.md``, "Moves").

Each attempt of a ``move`` command runs the whole protocol from the start, and every step is
idempotent, so a move restored from a snapshot (or delivered again) resumes from whatever its
last recorded phase was:

1. ``loading``: ``PUT /cache/holds/{move_id}`` on the target loads the keys its L1 lacks (its
   own L2 first, then the source's L1, then the source's private L2: the node's prefetch and
   peer fetch paths) and *holds* every key its L1 has (its LRU passes them by) for
   :data:`HOLD_TTL_S`. Its reply names the keys held and those no tier had (``missing``);
   a large move loads over several calls, one a pass (``unfinished``: not tried yet).
2. ``holding``: the source's copies are deleted only once the directory shows the target's
   L1 copies of the held keys (the target's ``store`` events came in, so routers and lookups
   never see zero copies either); until then the attempt is retried with backoff.
3. ``deleting``: ``DELETE /cache/objects`` (``tier`` ``l1``, never ``force``) on the source,
   of the held keys only, without those pinned now (``skipped``: a move is no forced
   delete); done when the directory shows none of those source copies in L1.
4. ``done``: the hold is released (``DELETE /cache/holds/{move_id}``; if that fails the hold
   ends by itself after :data:`HOLD_TTL_S`).

A move that fails once the target may hold some of its keys (a 4xx from the target or the
source, the source deregistering while the target loads) has its hold released too, at the end
of the delivery pass (:meth:`MoveSteps.failed`; best effort, as for ``done``).

The source's delete comes only after a hold the target confirmed in the same attempt, so a
target that restarted meanwhile (and lost its L1) is found out before anything is deleted. A
source that left (``source_left``: it deregistered or was fenced, recorded in the command by
the replica it was registered with, so every replica knows) has no L1 copies left to delete
(they went with its process). With the shared log (replicas), a source registered with another
replica than the target's has not left: the target's replica holds and lets the lease go, and
the source's replica deletes (:meth:`MoveSteps._delete_handed_over`: the hold confirmed at
most :data:`HANDOVER_S` ago, the target's copies in its directory). With ``keep_source`` the
move is a copy: steps 2-3 are skipped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Final, Protocol, TypeVar

import msgspec

from kvatlas.api.cache_control import (
    MAX_DELETE_KEYS,
    DeleteObjectsReply,
    EncodedKey,
    HoldReply,
    ReleaseReply,
    TierName,
)
from kvatlas.coordinator.cache_control.commands import FINISHED, Command, CommandLog, object_key
from kvatlas.errors import Unavailable
from kvatlas.keys import ObjectKey

HOLD_TTL_S: Final = 600.0
"""How long a target holds a move's keys after each attempt set the hold: far longer than a
retry's backoff (60 s at most) or a ``sent`` command's wait for its events (30 s)."""
HANDOVER_S: Final = 120.0
"""How recent a hold confirmed by another replica must be for the source's replica to delete
(the target registered with one replica, the source with another): twice the longest retry
wait, so the next attempt after a hand-over finds it recent."""
Failure = tuple[str, int | None]
T = TypeVar("T")


class MoveServer(Protocol):
    """The MP-server calls a move makes (``delivery_contract.MpServer`` has them)."""

    def delete_objects(
        self, keys: Sequence[EncodedKey], tier: TierName = "all", *, force: bool = False
    ) -> DeleteObjectsReply: ...

    def hold(
        self,
        hold_id: str,
        model_name: str,
        world_size: int,
        token_ids: Sequence[int],
        cache_salt: str,
        source_instance_id: str,
        ttl_s: float,
    ) -> HoldReply: ...

    def release(self, hold_id: str) -> ReleaseReply: ...


class Placement(Protocol):
    @property
    def instance_id(self) -> str: ...

    @property
    def tier(self) -> str: ...


class MoveFleet(Protocol):
    def url_of(self, instance_id: str) -> str | None: ...

    def registered_elsewhere(self, instance_id: str) -> bool: ...

    def copies(self, keys: Sequence[ObjectKey]) -> Sequence[Sequence[Placement]]: ...


class Carrier(Protocol):
    """What a move reads and calls of the delivery (``delivery.Delivery`` is one)."""

    @property
    def commands(self) -> CommandLog: ...

    @property
    def fleet(self) -> MoveFleet: ...

    def call(self, url: str, call: Callable[[MoveServer], T]) -> T: ...

    def pinned(self, keys: list[ObjectKey]) -> set[ObjectKey]: ...


def _failure(exc: Unavailable) -> Failure:
    return str(exc), getattr(exc, "reply_status", None)


def _delete_l1(keys: list[EncodedKey]) -> Callable[[MoveServer], DeleteObjectsReply]:
    return lambda server: server.delete_objects(keys, "l1")


def _count_deleted(removed: int) -> Callable[[Command], Command]:
    """Add a batch's removals to the count as it stands (a batch sent again by a later
    attempt counts 0 for the copies already gone: the source counts only what it removes)."""
    return lambda c: msgspec.structs.replace(c, deleted=c.deleted + removed)


def _release(hold_id: str) -> Callable[[MoveServer], ReleaseReply]:
    return lambda server: server.release(hold_id)


class MoveSteps:
    """One attempt of a move (:meth:`send`) and its completion (:meth:`check`), over the
    delivery's commands, fleet view, MP-server clients and pins."""

    def __init__(self, delivery: Carrier) -> None:
        self.d = delivery
        self._lock = threading.Lock()
        self._unheld: dict[str, str] = {}  # failed moves' holds to release: id -> target

    def failed(self, c: Command) -> None:
        """``c`` failed: if it is a move whose target may hold keys already, its hold is
        released by :meth:`release_failed` (the delivery pass's end: never on the caller's
        path, a deregistration's say)."""
        if c.kind == "move" and c.phase != "queued":
            with self._lock:
                self._unheld[c.command_id] = c.targets[0]

    def release_failed(self) -> None:
        """Release the holds of the moves :meth:`failed` named (best effort: a hold ends by
        itself after :data:`HOLD_TTL_S`; a target no longer registered took it with it)."""
        with self._lock:
            unheld, self._unheld = self._unheld, {}
        for move_id, target in unheld.items():
            url = self.d.fleet.url_of(target)
            if url is not None:
                with contextlib.suppress(Unavailable):
                    self.d.call(url, _release(move_id))

    def send(self, c: Command) -> Failure | None:
        """Steps 1-3 (the module docstring); ``None`` when the attempt went as far as it
        could (or finished the move), else why it stopped (retried with backoff; a 4xx
        fails the move)."""
        log, fleet = self.d.commands, self.d.fleet
        target, source = c.targets[0], c.source
        url = fleet.url_of(target)
        if c.phase in ("holding", "deleting") and c.source_left:
            # the target held every key; the source's L1 copies went with its process, so
            # there is nothing left to delete (and no source to load from for another hold)
            self._done(c, url)
            return None
        if url is None:
            source_url = fleet.url_of(source)
            if c.phase == "deleting" and source_url is not None:
                return self._delete_handed_over(c, source_url)
            return f"target {target!r} is not registered (or gave no http_port)", None
        if c.phase == "queued":
            c = log.progress(c.command_id, phase="loading")
            if c.state in FINISHED:  # failed meanwhile (an instance left)
                return None
        key = c.keys[0]
        try:
            reply = self.d.call(url, lambda s: s.hold(
                c.command_id, key.model_name, c.world_size, c.token_ids, key.cache_salt,
                source, HOLD_TTL_S,
            ))  # fmt: skip
        except Unavailable as exc:
            return _failure(exc)
        index = {object_key(k): i for i, k in enumerate(c.keys)}
        held = sorted({index[k] for k in map(object_key, reply.held) if k in index})
        if reply.unfinished:  # it loads in bounded calls: the next pass goes on
            log.progress(c.command_id, found_keys=len(held), missing=len(reply.missing))
            return None
        c = log.progress(c.command_id, phase="holding", found_keys=len(held),
                         missing=len(reply.missing), held_at=log.now())  # fmt: skip
        if c.state in FINISHED:
            return None
        if c.keep_source:
            self._done(c, url)
            return None
        if not self._target_shown(c, held):
            return f"the directory does not show {target!r}'s copies yet", None
        pinned = self.d.pinned([object_key(c.keys[i]) for i in held])
        moving = tuple(i for i in held if object_key(c.keys[i]) not in pinned)
        c = log.progress(c.command_id, phase="deleting", moving=moving,
                         skipped=len(held) - len(moving))  # fmt: skip
        if c.state in FINISHED:  # failed meanwhile (its target left): nothing more goes
            return None
        if c.source_left:  # its L1 copies went with its process
            self._done(c, url)
            return None
        source_url = fleet.url_of(source)
        if source_url is None:  # registered with another replica (shared log): it deletes
            return (f"source {source!r} is not registered with this replica: the replica it "
                    "registered with deletes its copies"), None  # fmt: skip
        return self._delete(c, source_url, target_here=True)

    def _target_shown(self, c: Command, held: Sequence[int]) -> bool:
        """Whether the directory shows the target's L1 copy of every key of ``held``."""
        copies = self.d.fleet.copies([object_key(c.keys[i]) for i in held])
        return all(any(cp.tier == "l1" and cp.instance_id == c.targets[0] for cp in cps)
                   for cps in copies)  # fmt: skip

    def _delete_handed_over(self, c: Command, source_url: str) -> Failure | None:
        """Step 3 on the replica the source is registered with, the target being registered
        with another (shared log): that one's attempt confirmed the hold (``held_at``) and
        let the lease go. Deletes only while that hold is recent (:data:`HANDOVER_S`) and
        this replica's directory shows the target's copies (a target that restarted since is
        found out by its new incarnation's events), without the keys pinned since."""
        age = self.d.commands.now() - c.held_at
        if age > HANDOVER_S:
            return (f"target {c.targets[0]!r} is not registered with this replica and its "
                    f"hold was confirmed {age:.0f} s ago: its replica holds again"), None  # fmt: skip
        if not self._target_shown(c, c.moving):
            return f"the directory does not show {c.targets[0]!r}'s copies yet", None
        pinned = self.d.pinned([object_key(c.keys[i]) for i in c.moving])
        if pinned:
            moving = tuple(i for i in c.moving if object_key(c.keys[i]) not in pinned)
            c = self.d.commands.progress(c.command_id, moving=moving,
                                         skipped=c.skipped + len(c.moving) - len(moving))  # fmt: skip
        if c.state in FINISHED:
            return None
        return self._delete(c, source_url, target_here=False)

    def _delete(self, c: Command, source_url: str, *, target_here: bool) -> Failure | None:
        """The source's delete, batch by batch; stops once the move failed (its target
        left: the source keeps the copies the target took with it)."""
        log, target = self.d.commands, c.targets[0]
        moving = c.moving
        for start in range(0, len(moving), MAX_DELETE_KEYS):
            if target_here and self.d.fleet.url_of(target) is None:  # it left, copies with it
                return None
            batch = [c.keys[i] for i in moving[start : start + MAX_DELETE_KEYS]]
            try:
                done = self.d.call(source_url, _delete_l1(batch))
            except Unavailable as exc:
                return _failure(exc)
            c = log.update(c.command_id, _count_deleted(done.deleted))
            if c.state in FINISHED:
                return None
        log.delivered(c.command_id)
        return None

    def check(self, c: Command) -> None:
        """A ``sent`` move (``deleting``): done once the directory shows none of the source's
        L1 copies it deletes, or the source left (``source_left``: they went with it). The
        target's replica finishes it (it releases the hold); any replica when the target is
        registered nowhere."""
        if c.state != "sent" or c.phase != "deleting":
            return
        fleet = self.d.fleet
        target_url = fleet.url_of(c.targets[0])
        if target_url is None and fleet.registered_elsewhere(c.targets[0]):
            return  # its replica finishes it, and releases the hold it cannot reach from here
        if not c.source_left:
            keys = [object_key(c.keys[i]) for i in c.moving]
            for cps in fleet.copies(keys):
                if any(cp.tier == "l1" and cp.instance_id == c.source for cp in cps):
                    return
        self._done(c, target_url)

    def _done(self, c: Command, target_url: str | None) -> None:
        """Release the hold (best effort: it expires by itself) and complete the move."""
        if target_url is not None:
            with contextlib.suppress(Unavailable):
                self.d.call(target_url, lambda s: s.release(c.command_id))
        log = self.d.commands
        log.progress(c.command_id, phase="done")
        log.finish(c.command_id, "completed", found_keys=c.found_keys)
