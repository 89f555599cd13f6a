"""Delivery: the coordinator carries each recorded command to the MP servers (``kvatlas node`` or
LMCache's ``lmcache server``: the same routes) and finishes it from what the directory shows.

- **Where**: a delete or eviction goes to its instance, which removes the keys from its L1
  and from its L2 (private, or the shared pool it is a member of). While that instance is not
  registered (down), its L1 copies are gone with its process (fenced) and a shared pool's copies
  are deleted through one live member of the pool instead; copies only it can reach (its private
  L2) wait for it. A prefetch goes to its instance (LMCache's ``POST /cache/prefetches``).
- **When**: every command the log says is due (:meth:`CommandLog.due`); an instance that cannot
  be reached leaves the command ``pending`` with its backoff; a refusal (4xx: the command can
  never apply) fails it; so does the instance's deregistration (:meth:`Delivery.instance_left`).
- **Done**: a delete when none of the copies it targets is left in the directory (the node's
  ``delete`` events, or the copies went by other means); a prefetch when its instance says it
  completed and the directory shows at least ``found_keys`` of its keys in that instance's L1.

The MP-server client is handed in (:data:`MpServers`: ``kvatlas.client.MPServerClient`` in a
``kvatlas coordinator`` process; the coordinator does not import the client package). Moves
follow their own protocol (:mod:`.moves`: load and hold on the target, then delete the
source's copies). Each pass first runs
:attr:`Delivery.eviction` (the fleet eviction pass, :mod:`.eviction_loop`, which records
``evict`` commands: delivered and finished as deletes); an ``evict`` command never sends a key
pinned since it was recorded. With the shared log (the Redis transport's replicas) a replica
delivers only the commands it holds the lease of (:meth:`CommandLog.claim`) and runs the
eviction pass only while it leads it (:meth:`CommandLog.leads`). It claims only the commands it
can carry (:meth:`Delivery.carries`): none whose instance it must reach (a move's target, or
once handed over its source) is registered with another replica only (it cannot reach their
MP servers, and a lease it took would make the replica that can wait out the lease and the
failed attempt's backoff). Whether a command is done is read from the directory, which every
replica has: any replica finishes it (:meth:`Delivery.check`; a move, its target's replica,
which releases the hold).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from kvatlas.coordinator.cache_control.commands import Command, CommandLog, object_key
from kvatlas.coordinator.cache_control.delivery_contract import (
    Copy,
    Fleet,
    MpServer,
    MpServers,
)
from kvatlas.coordinator.cache_control.moves import HANDOVER_S, MoveSteps
from kvatlas.errors import Unavailable
from kvatlas.keys import ObjectKey

log = logging.getLogger(__name__)
T = TypeVar("T")


PERIOD_S = 0.5
"""How often the loop finishes and delivers commands."""
WORKERS = 8
"""How many instances a pass delivers to at once (one thread each: the commands to one
instance are sent in order, one at a time; an instance beyond these waits for a later pass)."""


class _OneAtATime:
    """One holder per command at a time (the route's first attempt and the loop's may meet on
    a new command), and no wait between two commands: a slow delivery holds up only its own
    command (a fixed set of striped locks would make two commands on one stripe wait)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._held: set[str] = set()

    @contextlib.contextmanager
    def holding(self, command_id: str) -> Iterator[None]:
        with self._changed:
            while command_id in self._held:
                self._changed.wait()
            self._held.add(command_id)
        try:
            yield
        finally:
            with self._changed:
                self._held.discard(command_id)
                self._changed.notify_all()


def _failure(exc: Unavailable) -> tuple[str, int | None]:
    return str(exc), getattr(exc, "reply_status", None)


class Delivery:
    """Sends due commands and finishes them; :meth:`run_once` is one pass of the loop."""

    def __init__(self, commands: Callable[[], CommandLog], fleet: Fleet, servers: MpServers):
        self._commands = commands  # the log is replaced when a snapshot is restored
        self.fleet = fleet
        self.servers = servers
        self._sending = _OneAtATime()  # one delivery per command
        self._busy_lock = threading.Lock()
        self._busy: dict[str, set[str]] = {}  # instance -> the commands its worker sends
        self.eviction: Callable[[], object] | None = None
        """Run at the start of each pass (the fleet eviction pass, when it is due)."""
        self.pinned: Callable[[list[ObjectKey]], set[ObjectKey]] = lambda keys: set()
        """Those of the keys that hold a pin now (an ``evict`` command leaves them out)."""
        self.moves = MoveSteps(self)

    @property
    def commands(self) -> CommandLog:
        return self._commands()

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event) -> None:
        """The loop: :meth:`run_once` every :data:`PERIOD_S` until ``stop``."""
        away = False  # the shared log's Redis is away: said once, not at every pass
        while not stop.wait(PERIOD_S):
            try:
                self.run_once(wait=False)
            except Unavailable as exc:
                if not away:
                    log.warning("cache-control delivery paused: %s", exc)
                away = True
                continue
            except Exception:  # one bad pass must not end the loop
                log.exception("cache-control delivery pass failed")
            if away:
                log.info("cache-control delivery resumed")
            away = False

    def run_once(self, *, wait: bool = True) -> None:
        """Run the eviction pass if due (it records ``evict`` commands), finish what the
        directory shows done, deliver what is due, release the holds of moves that failed,
        drop old finished commands.

        What is due goes out on one thread per instance (its first target: a move's target),
        at most :data:`WORKERS` at once, so a slow instance (a large move's 4 s load calls, an
        unreachable host's timeout) delays only its own commands. ``wait``: return once they
        are sent (the loop does not wait: an instance whose worker is still busy, and the
        commands it carries, are left to a later pass)."""
        log_ = self.commands
        if self.eviction is not None and log_.leads("eviction"):
            try:
                self.eviction()
            except Unavailable:  # the shared store's Redis is away: the whole pass waits
                raise
            except Exception:  # deliveries go on without it
                log.exception("fleet eviction pass failed")
        unfinished = log_.unfinished()
        # shared log: one replica each, among those that can carry it
        owned = log_.claim(c.command_id for c in unfinished if self.carries(c))
        with self._busy_lock:  # a worker still sending them: not finished under its feet
            busy = set().union(*self._busy.values())
        for c in unfinished:  # done or not: the directory says, on every replica
            if c.command_id not in busy and (c.state == "sent" or c.kind in ("delete", "evict")):
                self.check(c)
        by_instance: dict[str, list[Command]] = {}
        for c in log_.due():
            if c.command_id in owned:
                by_instance.setdefault(c.targets[0], []).append(c)
        workers = []
        with self._busy_lock:
            for instance, due in by_instance.items():
                if instance in self._busy or len(self._busy) >= WORKERS:
                    continue  # a later pass
                self._busy[instance] = {c.command_id for c in due}
                worker = threading.Thread(
                    target=self._deliver_all, args=(instance, due), daemon=True,
                    name=f"kvatlas-delivery-{instance[:32]}",
                )  # fmt: skip
                workers.append(worker)
        for worker in workers:
            worker.start()
        if wait:
            for worker in workers:
                worker.join()
        self.moves.release_failed()  # the holds of moves that failed (best effort)
        log_.prune()

    def carries(self, c: Command) -> bool:
        """Whether this coordinator may take ``c`` on: an instance it must reach is registered
        here, or none is registered with another replica (nobody reaches it better: a shared
        pool's member, a failure, a move whose source left). A move must reach its target
        until the target holds the keys, then (handed over: ``deleting``) its source while
        that hold is recent (:data:`~.moves.HANDOVER_S`; after it, the target to hold again)."""
        if c.kind == "move":
            recent = self.commands.now() - c.held_at <= HANDOVER_S
            handed_over = c.phase == "deleting" and not c.source_left and recent
            needed = [c.source if handed_over else c.targets[0]]
        else:
            needed = [i for i in (*c.targets, c.source) if i]
        if any(self.fleet.url_of(i) is not None for i in needed):
            return True
        return not any(self.fleet.registered_elsewhere(i) for i in needed)

    def _deliver_all(self, instance: str, due: list[Command]) -> None:
        """One instance's due commands, in order (a worker of :meth:`run_once`)."""
        try:
            for c in due:
                self.deliver(c, as_due=True)
        except Unavailable as exc:  # the shared log's Redis is away: a later pass goes on
            log.warning("cache-control delivery to %s paused: %s", instance, exc)
        except Exception:  # one bad delivery must not stop the loop's later passes
            log.exception("cache-control delivery to %s failed", instance)
        finally:
            with self._busy_lock:
                del self._busy[instance]

    def instance_back(self, instance_id: str) -> None:
        """The instance (re-)registered: its pending commands are due now, not at the end of
        a backoff that grew while it was down. (The shared log's Redis away: nothing, they
        come due on their backoff; a registration never fails for it.)"""
        log_ = self.commands
        try:
            for c in log_.unfinished():
                if c.source == instance_id and c.source_left:  # back: its copies may be too
                    c = log_.progress(c.command_id, source_left=False)
                if c.state == "pending" and (instance_id in c.targets or c.source == instance_id):
                    log_.due_now(c.command_id)
        except Unavailable as exc:
            log.warning(
                "instance %s back: its cache-control commands not hastened (%s)", instance_id, exc
            )

    def instance_left(self, instance_id: str) -> list[Command]:
        """The instance deregistered: every unfinished command that needs it fails (but a move
        whose target holds the keys already: the source's copies went with it, the next
        attempt completes it). (The shared log's Redis away: they stay, carried on as for an
        instance that is down; a deregistration never fails for it.)"""
        failed = []
        try:
            for c in self.commands.unfinished():
                if c.source == instance_id and c.phase in ("holding", "deleting"):
                    self.commands.progress(c.command_id, source_left=True)
                    continue
                if instance_id in c.targets or c.source == instance_id:
                    reason = f"instance {instance_id!r} deregistered"
                    failed.append(self.commands.finish(c.command_id, "failed", reason))
                    self.moves.failed(failed[-1])
        except Unavailable as exc:
            log.warning(
                "instance %s left: its cache-control commands not failed (%s)", instance_id, exc
            )
        return failed

    def instance_fenced(self, instance_id: str) -> None:
        """The instance missed its heartbeats (fenced: its L1 is presumed gone): its moves as
        a source record that it left (``source_left``, in the command: every replica sees it,
        not only the one it was registered with), so they complete without deleting, as for
        a deregistration, unless it registers again first (:meth:`instance_back`); its moves
        as a target fail (its hold is presumed gone with its L1: another replica, whose
        directory may still show the target's copies, must not delete the source's)."""
        try:
            for c in self.commands.unfinished():
                if c.kind != "move":
                    continue
                if c.targets[0] == instance_id:  # its hold went with it: never delete now
                    reason = f"target {instance_id!r} missed its heartbeats (fenced)"
                    self.moves.failed(self.commands.finish(c.command_id, "failed", reason))
                elif c.source == instance_id and not c.source_left:
                    self.commands.progress(c.command_id, source_left=True)
        except Unavailable as exc:
            log.warning("instance %s fenced: its moves not told (%s)", instance_id, exc)

    # ------------------------------------------------------------------ one delivery

    def deliver(self, command: Command, *, as_due: bool = False) -> tuple[str, int | None] | None:
        """One attempt to send ``command``; ``None`` when it was delivered (or finished),
        else ``(error, the server's status or None: not reached)`` (the command is then
        pending with its backoff, or failed for a refusal). ``as_due``: the loop's copy, read
        from :meth:`CommandLog.due`; nothing is sent if the command changed since (the route's
        attempt or another replica delivered it, or pushed its next attempt out)."""
        # the route's first attempt and the loop may meet on a new command: one waits for
        # the other, then sends only if the command still needs it (its own answer stays true)
        with self._sending.holding(command.command_id):
            if not self.carries(command) or not self.commands.claim([command.command_id]):
                return None  # another replica holds it, or can reach it (and delivers it)
            current = self.commands.get(command.command_id)
            if current is None or current.state in ("completed", "failed"):
                return None
            if (as_due or current.state == "sent") and current.updated_at != command.updated_at:
                return None  # delivered (or tried) meanwhile
            if current.kind == "evict" or (current.kind == "delete" and not current.force):
                current = self._unpinned(current)
                if current is None:
                    return None
            if current.kind == "prefetch":
                failure = self._send_prefetch(current)
            elif current.kind == "move":
                failure = self.moves.send(current)
            else:
                failure = self._send_delete(current)
            if failure is not None:
                error, status = failure
                if status is not None and 400 <= status < 500:
                    self.moves.failed(self.commands.finish(command.command_id, "failed", error))
                else:
                    self.commands.delivery_failed(command.command_id, error)
                if self.fleet.url_of(current.targets[0]) is None or (
                    current.kind == "move" and self.fleet.url_of(current.source) is None
                ):
                    # its instance (a move's target or source) is not registered here: a
                    # replica it registered with may deliver it (shared log), so this one lets
                    # its lease go
                    self.commands.release([command.command_id])
        return failure

    def _unpinned(self, c: Command) -> Command | None:
        """``c`` without the keys pinned since it was recorded (``None``: it had only those,
        and is completed: nothing is left for it to remove). Checked at every delivery of an
        eviction or a delete without ``force``: a node may not have read a new pin yet, and
        a delete that a node answers by skipping a pinned key would never see it go."""
        pinned = self.pinned([object_key(k) for k in c.keys])
        if not pinned:
            return c
        keep = tuple(k for k in c.keys if object_key(k) not in pinned)
        if not keep:
            self.commands.finish(c.command_id, "completed", "every key was pinned meanwhile")
            return None
        return self.commands.progress(c.command_id, keys=keep)

    def _send_delete(self, c: Command) -> tuple[str, int | None] | None:
        target = c.targets[0]
        url = self.fleet.url_of(target)
        if url is not None:
            try:
                self.call(url, lambda s: s.delete_objects(c.keys, c.tier, force=c.force))
            except Unavailable as exc:
                return _failure(exc)
            self.commands.delivered(c.command_id)
            return None
        if not self.fleet.gone(target):  # (a restart: it may be alive and not heard yet)
            return f"instance {target!r} is not registered (yet, since this start)", None
        # gone: its L1 went with its process; a shared pool's copies go through another
        # member; its private L2 copies wait for it
        left = self._left(c)
        if any(not cp.shared for copies in left for cp in copies):
            return f"instance {target!r} is not registered (or gave no http_port)", None
        pools = {cp.backend for copies in left for cp in copies}
        for backend in sorted(pools):
            members = [m for m in self.fleet.pool_members(backend) if m != target]
            url = next((u for u in map(self.fleet.url_of, members) if u is not None), None)
            if url is None:
                return f"no live member of the shared pool {backend!r}", None
            try:
                self.call(url, lambda s: s.delete_objects(c.keys, "l2", force=c.force))
            except Unavailable as exc:
                return _failure(exc)
        self.commands.delivered(c.command_id)
        return None

    def _send_prefetch(self, c: Command) -> tuple[str, int | None] | None:
        url = self.fleet.url_of(c.targets[0])
        if url is None:
            return f"instance {c.targets[0]!r} is not registered (or gave no http_port)", None
        key = c.keys[0]
        try:
            reply = self.call(
                url,
                lambda s: s.submit_prefetch(
                    key.model_name, c.world_size, c.token_ids, key.cache_salt
                ),
            )
        except Unavailable as exc:
            return _failure(exc)
        if reply.status == "noop" or not isinstance(reply.request_id, str):
            self.commands.finish(c.command_id, "completed", found_keys=0)
        else:
            self.commands.delivered(c.command_id, (reply.request_id,))
        return None

    def call(self, url: str, call: Callable[[MpServer], T]) -> T:
        """``call`` on a client of the MP server at ``url`` (closed after)."""
        server = self.servers(url)
        try:
            return call(server)
        finally:
            server.close()

    # ------------------------------------------------------------------ completion

    def check(self, c: Command) -> None:
        """Finish ``c`` if the directory (and, for a prefetch, its instance) shows it done."""
        if c.kind == "prefetch":
            self._check_prefetch(c)
            return
        if c.kind == "move":
            self.moves.check(c)
            return
        if c.kind not in ("delete", "evict"):
            return
        target = c.targets[0]
        if c.state != "sent" and not self.fleet.gone(target):
            return  # its instance is up: it is asked before the command can be done
        if not any(self._left(c)):
            self.commands.finish(c.command_id, "completed")

    def _left(self, c: Command) -> list[list[Copy]]:
        """The copies of ``c``'s keys it targets that the directory still shows."""
        target = c.targets[0]
        keys = [object_key(k) for k in c.keys]
        pools = self.fleet.pools_of(target)
        return [
            [cp for cp in copies if _targeted(cp, target, c.tier, pools)]
            for copies in self.fleet.copies(keys)
        ]

    def _check_prefetch(self, c: Command) -> None:
        target = c.targets[0]
        found = c.found_keys
        if found is None:
            url = self.fleet.url_of(target)
            if url is None or not c.remote_ids:
                return
            try:
                status = self.call(url, lambda s: s.prefetch_status(c.remote_ids[0]))
            except Unavailable:
                return  # asked again on the next pass
            if status is None:  # the instance forgot it (restarted): submitted again
                self.commands.delivery_failed(c.command_id, "the instance forgot the prefetch")
                return
            if status.status != "completed" or not isinstance(status.found_keys, int):
                return
            found = status.found_keys
            c = self.commands.progress(c.command_id, found_keys=found)
        keys = [object_key(k) for k in c.keys]
        in_l1 = sum(
            any(cp.tier == "l1" and cp.instance_id == target for cp in copies)
            for copies in self.fleet.copies(keys)
        )
        if in_l1 >= found:
            self.commands.finish(c.command_id, "completed", found_keys=found)


def _targeted(cp: Copy, target: str, tier: str, pools: set[str]) -> bool:
    """Whether a delete of ``tier`` on ``target`` removes ``cp``: its L1, its private L2, the
    shared pools it is a member of."""
    if tier == "l1":
        return cp.tier == "l1" and cp.instance_id == target and not cp.shared
    if cp.tier == "l1":
        return tier == "all" and cp.instance_id == target and not cp.shared
    if cp.tier != "l2":
        return False
    if cp.shared:
        return cp.backend in pools or cp.instance_id == target
    return cp.instance_id == target
