"""Cache control kept in Redis, shared by every coordinator replica on one event stream: Redis is
the one source of truth for pins, quotas and commands when the Redis transport is configured,
and a replica keeps none of them in its memory between two requests.

Keys, all under ``<event stream>:cache:`` (so one ACL key pattern covers them,
``deploy/redis/users.acl``); each change is one Lua script, so it is atomic across replicas:

- ``pins`` (hash: packed key → count), ``pins:order`` (sorted set: packed key → the sequence
  number it was first pinned at, for LMCache's first-pinned order), ``meta`` (hash:
  ``pin_seq``, ``pins_version``: one more at every change, so a replica reads the pins only
  when they changed; ``pins_log_weight``, ``default_limit_gb``, ``seeded``), ``pins:log``
  (sorted set: each change's keys, counts and order by version, bounded: a replica applies the
  changes since its copy instead of reading every pin), ``quotas`` (hash: salt → limit in GB);
- ``commands`` (hash: id → the command record, msgpack of
  :class:`~.commands.Command`, whatever fields it has), ``commands:meta`` (hash: id →
  ``kind/state/revision``), ``commands:open`` (hash: id → revision, unfinished commands only),
  ``commands:counts`` (hash: ``kind/state`` → count), ``commands:done`` (sorted set: id → the
  time it finished, for pruning);
- ``lease:<command id>`` and ``lease:eviction`` (strings with an expiry: the replica working on
  a command, the one running fleet eviction passes).

**Snapshot**: Redis wins. A replica's snapshot still carries a copy of the shared state (its
``cache_control`` section), which seeds Redis only when Redis holds no cache-control state at
all (``meta.seeded`` absent: the first start on Redis, or a Redis that lost its data) — once,
by the first replica with a snapshot that reaches Redis (:meth:`SharedStore.ensure`); any
change marks Redis as holding state, so a snapshot never overrides what the fleet did. A
Redis that loses its data while the replicas run (FLUSHALL, a restart without persistence) is
seeded again the same way, from the last copy a replica read from Redis
(:meth:`SharedStore.watch`: every :data:`WATCH_S`); a change that finds it so before then
seeds it first (each change's script refuses a Redis without ``meta.seeded``:
:data:`UNSEEDED`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from kvatlas.errors import Unavailable
from kvatlas.redis_clients import redis_client

log = logging.getLogger(__name__)
WATCH_S: Final = 1.0
"""How often a replica with a copy of the state checks that Redis still holds it."""
NO_COPY_WAIT_S: Final = 3 * WATCH_S
"""How long a replica holding no copy refuses changes (503) to a Redis that lost the state
before it marks it itself: the replicas with a copy seed it within :data:`WATCH_S`; marking
it first would stop them (the fleet's pins, quotas and commands lost)."""

UNSEEDED: Final = "KVATLAS_UNSEEDED"
"""The error a change's script answers on a Redis holding no cache-control state
(``meta.seeded`` absent: it lost its data since this replica marked it)."""


class _Unseeded(Exception):
    """A change's script found Redis without the state (:data:`UNSEEDED`)."""


def _guarded(meta: str, body: str) -> str:
    """``body`` run only while Redis holds the state (``meta``: the KEYS entry of ``meta``):
    a change made to a Redis that lost its data before a replica seeded it again would be
    written over by the seed (:meth:`SharedStore.script` seeds or marks first, then retries)."""
    return (
        f"if redis.call('HEXISTS', {meta}, 'seeded') == 0 then\n"
        f"  return redis.error_reply('{UNSEEDED} Redis holds no cache-control state')\n"
        f"end\n{body}"
    )


_PIN_LOG: Final = """
-- the change's entry in pins:log (KEYS[4]), scored by its version: a weight (its keys + 1:
-- the log keeps at most ARGV[1] of them, oldest dropped first; a larger change is not logged)
-- and, per key, struct '>I4dd' (length, count now: 0 = unpinned, first-pinned seq: -1 = as
-- before) then the packed key
-- pins_epoch: set with the first change a Redis holds, so a Redis that lost its data (and
-- counts versions from 0 again) is told apart from the one a replica's copy came from
local function log_change(entry)
  redis.call('HSETNX', KEYS[3], 'pins_epoch', table.concat(redis.call('TIME'), '.'))
  local v = redis.call('HINCRBY', KEYS[3], 'pins_version', 1)
  local w, most = #entry / 2 + 1, tonumber(ARGV[1])
  if w <= most then
    redis.call('ZADD', KEYS[4], v, v .. ':' .. w .. ':' .. table.concat(entry))
    local total = redis.call('HINCRBY', KEYS[3], 'pins_log_weight', w)
    while total > most do
      local oldest = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
      redis.call('ZREM', KEYS[4], oldest)
      total = redis.call('HINCRBY', KEYS[3], 'pins_log_weight',
                         -tonumber(string.match(oldest, '^%d+:(%d+):')))
    end
  end
  return v
end
"""
PIN_SCRIPT: Final = _guarded(
    "KEYS[3]",
    _PIN_LOG
    + """
-- KEYS: pins, pins:order, meta, pins:log; ARGV: the log's weight, packed keys
local entry = {}
for i = 2, #ARGV do
  local f, seq = ARGV[i], -1
  local n = redis.call('HINCRBY', KEYS[1], f, 1)
  if n == 1 then
    seq = redis.call('HINCRBY', KEYS[3], 'pin_seq', 1)
    redis.call('ZADD', KEYS[2], seq, f)
  end
  entry[#entry + 1] = struct.pack('>I4dd', #f, n, seq)
  entry[#entry + 1] = f
end
return log_change(entry)
""",
)
UNPIN_SCRIPT: Final = _guarded(
    "KEYS[3]",
    _PIN_LOG
    + """
-- KEYS: pins, pins:order, meta, pins:log; ARGV: the log's weight, packed keys
local entry = {}
for i = 2, #ARGV do
  local f = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], f) == 1 then
    local n = redis.call('HINCRBY', KEYS[1], f, -1)
    if n <= 0 then
      n = 0
      redis.call('HDEL', KEYS[1], f)
      redis.call('ZREM', KEYS[2], f)
    end
    entry[#entry + 1] = struct.pack('>I4dd', #f, n, -1)
    entry[#entry + 1] = f
  end
end
return log_change(entry)
""",
)
RECORD_SCRIPT: Final = _guarded(
    "KEYS[6]",
    """
-- KEYS: commands, commands:meta, commands:open, commands:counts, commands:done, meta
-- ARGV: id, kind, state, record, finished (0/1), finished at, expected revision ('': any),
-- a new record's revision before its first ('': 0; a seed's is its time in ms, 13 digits,
-- which Lua's number format keeps whole)
local id, finished = ARGV[1], ARGV[5] == '1'
local rev = tonumber(ARGV[8]) or 0
local m = redis.call('HGET', KEYS[2], id)
if m then
  local kind, state, r = string.match(m, '^([^/]*)/([^/]*)/(%d+)$')
  rev = tonumber(r)
  if ARGV[7] ~= '' and tonumber(ARGV[7]) ~= rev then return -1 end
  if (state == 'completed' or state == 'failed') and ARGV[3] ~= state then return -2 end
  redis.call('HINCRBY', KEYS[4], kind .. '/' .. state, -1)
elseif ARGV[7] ~= '' and ARGV[7] ~= '0' then
  return -1
end
rev = rev + 1
local label = ARGV[2] .. '/' .. ARGV[3]
redis.call('HSET', KEYS[2], id, label .. '/' .. rev)
redis.call('HINCRBY', KEYS[4], label, 1)
redis.call('HSET', KEYS[1], id, ARGV[4])
if finished then
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZADD', KEYS[5], ARGV[6], id)
else
  redis.call('HSET', KEYS[3], id, rev)
end
return rev
""",
)
FIELD_SCRIPT: Final = _guarded(
    "KEYS[1]",
    """
-- KEYS: meta, a hash; ARGV: field, value ('': delete the field). Returns HSET's or HDEL's reply.
if ARGV[2] == '' then return redis.call('HDEL', KEYS[2], ARGV[1]) end
return redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
""",
)
PRUNE_SCRIPT: Final = """
-- KEYS as RECORD_SCRIPT's; ARGV: cutoff, most to drop
local ids = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for i, id in ipairs(ids) do
  local m = redis.call('HGET', KEYS[2], id)
  if m then
    redis.call('HINCRBY', KEYS[4], string.match(m, '^([^/]*/[^/]*)/'), -1)
  end
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[5], id)
end
return #ids
"""
CLAIM_SCRIPT: Final = """
-- KEYS: leases; ARGV: owner, lease in ms, the owner of this replica's previous run ('': none):
-- its leases are this run's. Returns the 1-based indexes now held by owner.
local held = {}
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if not v or (ARGV[3] ~= '' and v == ARGV[3]) then
    redis.call('SET', k, ARGV[1], 'PX', ARGV[2])
    held[#held + 1] = i
  elseif v == ARGV[1] then
    redis.call('PEXPIRE', k, ARGV[2])
    held[#held + 1] = i
  end
end
return held
"""
RELEASE_SCRIPT: Final = """
-- KEYS: leases; ARGV: owner. Frees those the owner holds.
for i, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) end
end
return 0
"""
SCRIPTS: Final = {
    "pin": PIN_SCRIPT,
    "unpin": UNPIN_SCRIPT,
    "record": RECORD_SCRIPT,
    "field": FIELD_SCRIPT,
    "prune": PRUNE_SCRIPT,
    "claim": CLAIM_SCRIPT,
    "release": RELEASE_SCRIPT,
}


class SharedStore:
    """The Redis client, key names and scripts of one fleet's shared cache-control state.

    Every Redis error surfaces as :class:`~kvatlas.errors.Unavailable` (a route answers 503,
    the delivery loop tries again at its next pass). :meth:`ensure` runs before the first
    operation (and from :meth:`watch` at start-up): it seeds an empty Redis with ``seed`` (the
    snapshot's section, when the replica restored one, then each copy its snapshots read from
    Redis); :meth:`watch` seeds it again should Redis lose the state later."""

    def __init__(self, client: Any, stream: str, owner: str) -> None:
        import redis

        self._errors = redis.RedisError
        self.client = client
        self.prefix = f"{stream}:cache:"
        self.owner = owner  # this process's name on leases (replica id, pid, random)
        self.predecessor = ""
        """The owner of this replica's previous run, once known gone (:meth:`succeed`): the
        leases it held are this run's to take at once, not when they lapse."""
        self.seed: Callable[[], None] | None = None
        """Writes this replica's last copy of the state into a Redis that holds none (set by
        the restore, then by each snapshot that read the state from Redis)."""
        self.reseeds = 0
        """How many times this replica seeded a Redis that had lost the state it held."""
        self._ensured = False
        self._unseeded_at: float | None = None  # a change first found the state gone (no copy)
        self._held = False  # this process saw Redis hold the state (a seed now is a re-seed)
        self._ensure_lock = threading.Lock()
        self._scripts = {name: client.register_script(text) for name, text in SCRIPTS.items()}

    @classmethod
    def connect(cls, redis_url: str, stream: str, owner: str) -> SharedStore:
        return cls(redis_client(redis_url, socket_timeout=5), stream, owner)

    def key(self, name: str) -> str:
        return self.prefix + name

    @property
    def command_keys(self) -> list[str]:
        return [self.key(n) for n in ("commands", "commands:meta", "commands:open",
                                      "commands:counts", "commands:done")]  # fmt: skip

    def call(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """One Redis command that reads (after :meth:`ensure`)."""
        self.ensure()
        return self._raw(command, *args, **kwargs)

    def script(self, name: str, keys: list[str], args: list[Any], *, write: bool = True) -> Any:
        """One of :data:`SCRIPTS` (``write``: it changes pins, quotas or commands). A change
        that finds Redis without the state (it lost its data since this replica marked it,
        and no replica has seeded it yet) seeds it first, then runs: the seed would otherwise
        write over it. A replica holding no copy refuses the change (``Unavailable``) for
        :data:`NO_COPY_WAIT_S`, for one with a copy to seed, then marks Redis itself."""
        self.ensure(write=write)
        try:
            reply = self._run(name, keys, args, unseeded=write)
        except _Unseeded:
            pass
        else:
            self._unseeded_at = None  # (Redis holds the state: a later loss waits again)
            return reply
        with self._ensure_lock:
            now = time.monotonic()
            if self.seed is None and now - (self._unseeded_at or now) < NO_COPY_WAIT_S:
                self._unseeded_at = self._unseeded_at or now
                raise Unavailable(
                    "cache-control store: Redis lost the cache-control state; a replica with a "
                    "copy seeds it again within seconds (this one holds none): try again"
                )
            self._unseeded_at = None
            self._ensured = False
            self._mark(noticed=True)
        return self._run(name, keys, args, unseeded=False)

    def _run(self, name: str, keys: list[str], args: list[Any], *, unseeded: bool) -> Any:
        """The script's reply; :class:`_Unseeded` when it refused a Redis without the state
        and ``unseeded`` (else every Redis error is :class:`Unavailable`)."""
        try:
            return self._scripts[name](keys=keys, args=args)
        except self._errors as exc:
            if unseeded and str(exc).startswith(UNSEEDED):
                raise _Unseeded from None
            raise Unavailable(f"cache-control store (redis {name} script): {exc}") from exc

    def set_field(self, hash_name: str, field: str, value: str | None) -> int:
        """``HSET`` (``HDEL`` for ``None``) of one field of the hash ``hash_name`` (a key
        name: :meth:`key`), as a change (:meth:`script`)."""
        keys = [self.key("meta"), self.key(hash_name)]
        return int(self.script("field", keys, [field, "" if value is None else value]))

    def transaction(self, build: Callable[[Any], object], *, write: bool = False) -> list[Any]:
        """The replies of the commands ``build`` queues on a MULTI/EXEC pipeline: one
        consistent read of several keys (or one atomic write)."""
        self.ensure(write=write)
        try:
            pipe = self.client.pipeline(transaction=True)
            build(pipe)
            replies: list[Any] = pipe.execute()
        except self._errors as exc:
            raise Unavailable(f"cache-control store (redis transaction): {exc}") from exc
        return replies

    def ensure(self, *, write: bool = False) -> None:
        """Before a change (``write``), mark Redis as holding this fleet's cache-control state;
        a replica with a copy of the state (``seed``) does it at once, and if Redis held no
        state yet it seeds it first. Reads and leases mark nothing (a replica that only reads
        cannot stop another's snapshot from seeding an empty Redis). At most once per process
        once done (:meth:`check` undoes it when Redis lost the state); raises
        :class:`Unavailable` while Redis is away."""
        if self._ensured or (self.seed is None and not write):
            return
        with self._ensure_lock:
            if not self._ensured:
                self._mark()

    def _mark(self, *, noticed: bool = False) -> bool:
        """:meth:`ensure`'s step, under its lock: mark Redis (``HSETNX meta.seeded``, atomic:
        one replica is first) and, if first, seed it; True: this replica seeded a Redis that
        had lost the state it saw (counted in :attr:`reseeds`). ``noticed``: :meth:`check`
        found the state gone."""
        seed, lost = self.seed, self._held
        mark = f"{self.owner}/{time.time_ns()}"  # which seeding: a new one reads differently
        first = bool(self._raw("hsetnx", self.key("meta"), "seeded", mark))
        if first and seed is not None:
            if lost:
                log.warning("cache control: Redis lost the fleet's pins, quotas and commands; "
                            "seeding it again from this replica's last copy")  # fmt: skip
            else:
                log.info("cache control: Redis held none; seeding it from the snapshot")
            self._ensured = True  # the seed's own calls go through
            try:
                seed()
            except BaseException:
                self._ensured = False
                self._raw("hdel", self.key("meta"), "seeded")
                raise
            self.reseeds += lost
        elif first and noticed:  # (a change found the state gone: :meth:`script`)
            log.warning("cache control: Redis lost the fleet's state and this replica holds "
                        "no copy to seed it with; it holds the changes made since")  # fmt: skip
        elif noticed:
            log.warning("cache control: Redis lost the fleet's state; another replica seeded it")
        elif seed is not None:
            log.info("cache control: Redis holds the fleet's state; the snapshot's is not applied")
        self._ensured = self._held = True
        return first and seed is not None and lost

    def holds_state(self) -> bool:
        """Whether Redis holds this fleet's cache-control state (``meta.seeded``)."""
        return self.seeding() is not None

    def seeding(self) -> bytes | None:
        """Which seeding of the state Redis holds (``meta.seeded``: who marked it, when);
        ``None``: it holds none. A copy read between two equal answers is of one state."""
        mark: bytes | None = self._raw("hget", self.key("meta"), "seeded")
        self._held = self._held or mark is not None
        return mark

    def check(self) -> bool:
        """For a replica with a copy of the state (``seed``; nothing to do otherwise): at
        start-up :meth:`ensure`, and later, should Redis no longer hold the state (it lost its
        data), seed it again — the first replica to notice does, the others find it seeded.
        True: this replica seeded it again. Raises :class:`Unavailable` while Redis is away."""
        if self.seed is None:
            return False
        with self._ensure_lock:  # another thread's ensure waits for this one
            noticed = self._ensured
            if noticed and self.holds_state():
                return False
            self._ensured = False
            return self._mark(noticed=noticed)

    def watch(self, stop: threading.Event, every_s: float = WATCH_S) -> None:
        """:meth:`check` every ``every_s`` (with backoff while Redis is away, or after a seed
        failed: logged, tried again) until ``stop``."""
        from kvatlas.backoff import Backoff

        backoff = Backoff(0.1, 2.0)
        while not stop.is_set():
            try:
                self.check()
            except Unavailable as exc:
                log.debug("cache-control store not reached: %s", exc)
                stop.wait(backoff.next_wait())
                continue
            except Exception:  # a copy that does not seed: the watch goes on
                log.exception("cache control: seeding Redis failed")
                stop.wait(max(backoff.next_wait(), every_s))
                continue
            backoff.reset()
            stop.wait(every_s)

    def succeed(self, replica_id: str) -> None:
        """This run of replica ``replica_id`` holds its consumer group, so no other run of it
        is alive (``consumer_group.ensure_group_free``): record this run as the replica's
        owner, and the one recorded before as its predecessor, whose command leases (a run
        killed with ``-9``) this one takes at once. Redis away: they lapse, as before."""
        try:
            before = self._raw("set", self.key(f"owner:{replica_id}"), self.owner, get=True)
        except Unavailable as exc:
            log.warning("cache control: the previous run's leases are left to lapse (%s)", exc)
            return
        if before is not None and before.decode() != self.owner:
            self.predecessor = before.decode()
            log.info("cache control: this run takes over the leases of replica %s's previous "
                     "run (%s)", replica_id, self.predecessor)  # fmt: skip

    def _raw(self, command: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, command)(*args, **kwargs)
        except self._errors as exc:
            raise Unavailable(f"cache-control store (redis {command}): {exc}") from exc
