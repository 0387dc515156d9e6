"""Lua sources used by :mod:`locking`, as named constants, plus a per-client cache.

Every script is atomic on the server, which is the whole point: a check followed by a
write from the client would let another client slip in between the two.

Scripts are called by their SHA1 (EVALSHA), loaded again when the server answers NOSCRIPT, so
a Redis that restarted empty keeps working.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

# The lock's helper keys, all derived from the lock name:
#   <name>:queue          list of waiting tokens, oldest first (FIFO order)
#   <name>:waiters        hash token -> "<deadline ms> <ttl ms>[ <wake list>]" for every
#                         queued token
#   <name>:wake:<token>   one waiter's wake: the release that hands it the lock pushes here
#                         the fence it was granted; or, for a waiter whose entry names a wake
#                         list (a process's wake hub, locking.wakes), the release pushes
#                         "<token> <fence>" onto that list instead
#   <name>:fence          the fencing token of the lock's latest grant (see grant_fence)
# A token is in the list exactly when it is in the hash; every script below changes both
# together. The deadline is Redis server time (TIME), so waiters' clocks do not matter.
# The list and the hash share one expiry, never shorter than the latest deadline of an
# entry; a wake key lives a few seconds. Nothing outlives the waiters that created it.
# TIME followed by writes needs effects replication, the default since Redis 5 (and the
# only mode since 7), so no script calls redis.replicate_commands().
# The release script builds the next waiter's wake key from the lock name (or reads it from the
# waiter's entry), and every grant the fence key, keys they are not passed in KEYS. On a Redis
# Cluster the lock's name carries a hash tag (locking.Lock insists), so those keys share the
# slot of the keys passed; a wake hub's list (another slot) is for a single Redis only.

# Every script that grants a lock (to a caller, to a queued waiter, to the first free shard)
# also hands out a fencing token: a number that grows with every grant of that lock name, so
# that a store written under the lock can refuse a write whose token is older than one it has
# accepted (a holder that was paused past its TTL and wakes up believing it still holds the
# lock). It is max(last + 1, Redis server TIME in microseconds): it grows by at least one per
# grant, and it goes on growing when Redis restarted empty (or the key expired), since the
# server's clock has moved on meanwhile; a replica promoted in a failover has the replicated
# last value. The key is the one helper key that outlives the lock: it lives an hour after
# the last grant, so that the fence goes on growing even if the server's clock steps back
# (by less than the time since the previous grant, once the key is gone). The holder learns
# its fence when it is granted (or, for a holder whose lock holds its token, from the key:
# the latest grant was its).
# A Lua number holds integers exactly up to 2^53, about 285 years of microseconds.
_GRANT_FENCE_FUNCTION = """
local function grant_fence(lock)
    local key = lock .. ':fence'
    local last = tonumber(redis.call('get', key)) or 0
    local now = redis.call('time')
    local fence = math.max(last + 1, tonumber(now[1]) * 1000000 + tonumber(now[2]))
    redis.call('set', key, string.format('%.0f', fence), 'PX', 3600000)
    return fence
end
local function current_fence(lock)
    return tonumber(redis.call('get', lock .. ':fence')) or 0
end
"""

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters, KEYS[4] this waiter's wake key
# ARGV[1] owner token, ARGV[2] lock TTL in ms ("0": none),
# ARGV[3] how long a queue entry stays valid, in ms ("0": take the lock if free, never queue),
# ARGV[4] the list a release that hands us the lock pushes our wake onto ("": our own wake key)
# Returns {1, 0, fence} when the lock is ours: it was free and is now set to ARGV[1] (a new
# grant: fence is its fencing token), or it already held ARGV[1] (handed over to us, or an
# earlier run of this very call, whose reply was lost, took it: fence is that grant's). Our
# queue entry and wake are dropped then.
# Otherwise returns {0, PTTL of the lock} and, when ARGV[3] > 0, makes sure ARGV[1] is
# queued: appended at the tail the first time, its deadline (TIME + ARGV[3]) refreshed in
# place on later calls, so one acquisition never holds two places.
# A free lock is taken even when others are queued (it only happens when the last holder's
# lock expired, or no queued entry was still valid at its release): queued waiters are
# woken no later than the expiry and retry, so nobody waits forever.
TAKE_OR_QUEUE = (
    _GRANT_FENCE_FUNCTION
    + """
local held = redis.call('get', KEYS[1])
if held and held ~= ARGV[1] then
    local ttl = redis.call('pttl', KEYS[1])
    local valid = tonumber(ARGV[3])
    if valid > 0 then
        local now = redis.call('time')
        local deadline = now[1] * 1000 + math.floor(now[2] / 1000) + valid
        local entry = string.format('%.0f %s', deadline, ARGV[2])
        if ARGV[4] ~= '' then
            entry = entry .. ' ' .. ARGV[4]
        end
        if redis.call('hset', KEYS[3], ARGV[1], entry) == 1 then
            redis.call('rpush', KEYS[2], ARGV[1])
        end
        local keep = math.max(valid, redis.call('pttl', KEYS[2]))
        redis.call('pexpire', KEYS[2], keep)
        redis.call('pexpire', KEYS[3], keep)
    end
    return {0, ttl}
end
local fence
if held then
    fence = current_fence(KEYS[1])
else
    if ARGV[2] == '0' then
        redis.call('set', KEYS[1], ARGV[1])
    else
        redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
    end
    fence = grant_fence(KEYS[1])
end
if redis.call('hdel', KEYS[3], ARGV[1]) == 1 then
    redis.call('lrem', KEYS[2], 1, ARGV[1])
end
redis.call('del', KEYS[4])
return {1, 0, fence}
"""
)

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters
# ARGV[1] owner token, ARGV[2] wake key lifetime (ms)
# Returns 0 when the lock does not hold ARGV[1]: the lock is left untouched, only a queue
# entry of ARGV[1] is withdrawn (a token whose acquisition failed midway must not be
# handed the lock later). Otherwise:
# * hands the lock over: pops the queue head, skipping entries whose deadline (server
#   TIME) has passed, sets the lock to that waiter's token with that waiter's TTL, pushes
#   the waiter's fencing token (a new grant) onto its own wake (or "<token> <fence>" onto
#   the wake list its entry names) and returns 2. The waiter
#   owns the lock from this moment on, without a round trip of its own; a waiter that died
#   while queued is handed the lock all the same, which then expires after its TTL like a
#   crashed holder's.
# * deletes the lock when no valid entry is queued, and returns 1.
RELEASE = (
    _GRANT_FENCE_FUNCTION
    + """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
    if redis.call('hdel', KEYS[3], ARGV[1]) == 1 then
        redis.call('lrem', KEYS[2], 1, ARGV[1])
    end
    return 0
end
local now
while true do
    local waiter = redis.call('lpop', KEYS[2])
    if not waiter then
        break
    end
    local entry = redis.call('hget', KEYS[3], waiter)
    if entry then
        redis.call('hdel', KEYS[3], waiter)
        if not now then
            local time = redis.call('time')
            now = time[1] * 1000 + math.floor(time[2] / 1000)
        end
        local space = string.find(entry, ' ', 1, true)
        local rest = string.sub(entry, space + 1)
        local ttl, hub = rest, nil
        local second = string.find(rest, ' ', 1, true)
        if second then
            ttl, hub = string.sub(rest, 1, second - 1), string.sub(rest, second + 1)
        end
        if tonumber(string.sub(entry, 1, space - 1)) > now then
            if ttl == '0' then
                redis.call('set', KEYS[1], waiter)
            else
                redis.call('set', KEYS[1], waiter, 'PX', ttl)
            end
            local fence = string.format('%.0f', grant_fence(KEYS[1]))
            local wake = hub
            if hub then
                redis.call('rpush', hub, waiter .. ' ' .. fence)
            else
                wake = KEYS[1] .. ':wake:' .. waiter
                redis.call('rpush', wake, fence)
            end
            redis.call('pexpire', wake, ARGV[2])
            return 2
        end
    end
end
redis.call('del', KEYS[1])
return 1
"""
)

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters, KEYS[4] this waiter's wake key
# ARGV[1] owner token
# A waiter giving up. Returns {1, fence} when the lock holds ARGV[1] (a release handed it
# over just now, with that fencing token): the waiter keeps it. Returns {0, 0} otherwise.
# Either way the waiter's queue entry and wake are gone afterwards, so no later release can
# hand it the lock: whatever this script answers is final.
CANCEL = (
    _GRANT_FENCE_FUNCTION
    + """
if redis.call('hdel', KEYS[3], ARGV[1]) == 1 then
    redis.call('lrem', KEYS[2], 1, ARGV[1])
end
redis.call('del', KEYS[4])
if redis.call('get', KEYS[1]) == ARGV[1] then
    return {1, current_fence(KEYS[1])}
end
return {0, 0}
"""
)

# KEYS[1] lock name
# ARGV[1] owner token, ARGV[2] milliseconds, ARGV[3] "1" to replace the TTL with
# ARGV[2], "0" to add ARGV[2] to the current TTL.
# Returns 1 when the lock was ours and its TTL changed, 0 otherwise. A key without a
# TTL is left alone (same rule as redis-py), so a lock never turns into an expiring one.
EXTEND = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
    return 0
end
local current = redis.call('pttl', KEYS[1])
if current < 0 then
    return 0
end
local ttl = tonumber(ARGV[2])
if ARGV[3] == '0' then
    ttl = ttl + current
end
redis.call('pexpire', KEYS[1], ttl)
return 1
"""

# KEYS[1] stock counter
# ARGV[1] quantity (positive integer)
# Returns -2 when the counter does not exist, -1 when it holds less than the quantity,
# otherwise the value after the decrement (>= 0). A missing counter is reported rather
# than created: DECRBY on a missing key would start it at -qty.
STOCK_TAKE = """
local raw = redis.call('get', KEYS[1])
if not raw then
    return -2
end
local stock = tonumber(raw)
if not stock then
    return redis.error_reply('stock counter ' .. KEYS[1] .. ' does not hold an integer')
end
local qty = tonumber(ARGV[1])
if stock < qty then
    return -1
end
return redis.call('decrby', KEYS[1], qty)
"""

# A Lua function shared by the scripts that take units spread over several counters (prefixed
# to their text). take_spread(cursor, first, last, qty) reads the counters KEYS[first..last]
# (the stock rows of one item; counter i is row i - first) and returns {-2} when one does not exist,
# {-1, units left in all} when together they hold less than qty (nothing changed then),
# otherwise the units taken as a flat list {row, units, row, units, ...}: from one counter that
# holds all of qty when one does (the first such counter at or after the cursor key's position,
# so that takers land on the rows in turn), else from several, lowest row first. Every counter
# is read and decremented in the one script, so concurrent takers cannot oversell any of them.
_TAKE_SPREAD_FUNCTION = """
local function take_spread(cursor, first, last, qty)
    local n = last - first + 1
    local levels = redis.call('mget', unpack(KEYS, first, last))
    local total = 0
    for i = 1, n do
        if not levels[i] then
            return {-2}
        end
        local level = tonumber(levels[i])
        if not level then
            return redis.error_reply('stock counter ' .. KEYS[first + i - 1] .. ' is no integer')
        end
        levels[i] = level
        total = total + level
    end
    if total < qty then
        return {-1, total}
    end
    local start = redis.call('incr', cursor) % n
    for step = 0, n - 1 do
        local i = (start + step) % n + 1
        if levels[i] >= qty then
            redis.call('decrby', KEYS[first + i - 1], qty)
            return {i - 1, qty}
        end
    end
    local taken = {}
    local needed = qty
    for i = 1, n do
        if needed > 0 and levels[i] > 0 then
            local units = math.min(levels[i], needed)
            redis.call('decrby', KEYS[first + i - 1], units)
            taken[#taken + 1] = i - 1
            taken[#taken + 1] = units
            needed = needed - units
        end
    end
    return taken
end

-- A checkout's claim on its idempotency key: while a twin (a retry with the same key) holds
-- units, another take with the key answers {-3} and takes nothing, sold out or not, so that
-- it waits for the twin's order instead of answering before it. `ttl` is nil (no key) or the
-- claim's lifetime in ms; the claim (holding the taker's token) is set only when units are
-- taken.
local function claimed(claim, ttl)
    return ttl and redis.call('exists', claim) == 1
end
local function claim(claim, ttl, token, taken)
    if ttl and taken[1] >= 0 then
        redis.call('set', claim, token, 'PX', ttl)
    end
    return taken
end
"""

# KEYS[1] cursor (an integer key, created at 1 on first use), KEYS[2..n+1] the stock counters
# of one item's n stock rows, then, with ARGV[2], KEYS[n+2] the checkout's idempotency claim
# ARGV[1] quantity (positive integer), ARGV[2] and ARGV[3] (optional) the claim's TTL in ms
# and the taker's token
# Returns {-3} when a twin holds the claim, otherwise what take_spread returns (above).
STOCK_TAKE_SPREAD = (
    _TAKE_SPREAD_FUNCTION
    + """
local ttl = ARGV[2]
local last = ttl and #KEYS - 1 or #KEYS
if claimed(KEYS[#KEYS], ttl) then
    return {-3}
end
return claim(KEYS[#KEYS], ttl, ARGV[3], take_spread(KEYS[1], 2, last, tonumber(ARGV[1])))
"""
)

# Many takes of STOCK_TAKE_SPREAD in one script, in order, each as if run alone. Takes from the
# same counters (one sale's: the usual batch) name their cursor and counters once, as a group.
# KEYS: per group, its cursor and then its n stock counters; after the groups, the idempotency
# claim of each take that has one, in the order of the takes.
# ARGV[1] the number of groups g, ARGV[2..g+1] each group's n; then, four per take: its group
# (from 1), the quantity, and the claim's TTL in ms and the taker's token (both "" without a
# claim).
# Returns, per take, the length of its reply and then the reply STOCK_TAKE_SPREAD gives.
STOCK_TAKE_SPREAD_MANY = (
    _TAKE_SPREAD_FUNCTION
    + """
local groups = tonumber(ARGV[1])
local cursors, lasts = {}, {}
local k = 1
for g = 1, groups do
    cursors[g] = k
    lasts[g] = k + tonumber(ARGV[1 + g])
    k = lasts[g] + 1
end
local out = {}
for a = groups + 2, #ARGV, 4 do
    local g = tonumber(ARGV[a])
    local qty = tonumber(ARGV[a + 1])
    local ttl = ARGV[a + 2]
    local claim_key
    if ttl == '' then
        ttl = nil
    else
        claim_key = KEYS[k]
        k = k + 1
    end
    local reply
    if claimed(claim_key, ttl) then
        reply = {-3}
    else
        reply = take_spread(KEYS[cursors[g]], cursors[g] + 1, lasts[g], qty)
        if reply.err then
            return reply
        end
        reply = claim(claim_key, ttl, ARGV[a + 3], reply)
    end
    out[#out + 1] = #reply
    for i = 1, #reply do
        out[#out + 1] = reply[i]
    end
end
return out
"""
)

# KEYS[1..n] the stock counters (hints) of n rows, KEYS[n+1..2n] the locks of those rows
# ARGV[1] quantity, ARGV[2] the row to try first (0-based), ARGV[3] owner token,
# ARGV[4] lock TTL in ms
# Returns {-2} when a counter does not exist (nothing locked). Otherwise
# {row, fence, level of row 0, ..., level of row n-1}: row is the first at or after ARGV[2],
# in turn, whose counter holds the quantity and whose lock was free, now locked with the token
# (SET NX PX, as a non-blocking acquire of locking.Lock does: a lock with waiters queued is
# never free, a release hands it over), or -1 when every such row is locked (or none holds the
# quantity); fence is the fencing token of that row's lock's grant (0 when none was locked).
# Choosing the row and locking it in one script saves a round trip per sale.
LOCK_FIRST_HOLDING = (
    _GRANT_FENCE_FUNCTION
    + """
local n = #KEYS / 2
local levels = redis.call('mget', unpack(KEYS, 1, n))
for i = 1, n do
    if not levels[i] then
        return {-2}
    end
    levels[i] = tonumber(levels[i])
end
local qty = tonumber(ARGV[1])
local start = tonumber(ARGV[2])
local picked = -1
local fence = 0
for step = 0, n - 1 do
    local i = (start + step) % n + 1
    if levels[i] >= qty and redis.call('set', KEYS[n + i], ARGV[3], 'NX', 'PX', ARGV[4]) then
        picked = i - 1
        fence = grant_fence(KEYS[n + i])
        break
    end
end
local reply = {picked, fence}
for i = 1, n do
    reply[#reply + 1] = levels[i]
end
return reply
"""
)

# KEYS[1] a key, ARGV[1] a value: deletes the key if it holds the value (a claim given up by
# its taker, never one a twin set after it expired). Returns 1 if deleted, else 0.
DELETE_IF_EQUAL = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

# KEYS[1..n] counters, KEYS[n+1..2n] the version of each (the version of the value it holds)
# ARGV[1] '1' to create missing counters, ARGV[2] '1' to overwrite whatever version is there,
# then per counter its value and that value's version (integers)
# Sets each counter (and its version) unless it already holds a value of a later version:
# writers that each read a row's level and version from the database, in any order, leave the
# counter at the latest (a copy of the same version rewrites it: it is as true). Without
# ARGV[1] a missing counter stays missing.
# Returns how many counters were set.
STOCK_SET_NEWER = """
local n = #KEYS / 2
local create, force = ARGV[1] == '1', ARGV[2] == '1'
local set = 0
for i = 1, n do
    local version = tonumber(ARGV[2 * i + 2])
    local seen = tonumber(redis.call('get', KEYS[n + i]) or '-1')
    local exists = redis.call('exists', KEYS[i]) == 1
    if (exists or create) and (force or not exists or version >= seen) then
        redis.call('set', KEYS[i], ARGV[2 * i + 1])
        redis.call('set', KEYS[n + i], version)
        set = set + 1
    end
end
return set
"""

# KEYS[1] stock counter
# ARGV[1] quantity (positive integer)
# Returns -2 when the counter does not exist (it stays missing: INCRBY would create it
# and resurrect a counter that was deliberately removed), otherwise the new value.
STOCK_GIVE_BACK = """
if redis.call('exists', KEYS[1]) == 0 then
    return -2
end
return redis.call('incrby', KEYS[1], ARGV[1])
"""

# KEYS[1] marker, KEYS[2..n] stock counters
# ARGV[1] marker lifetime (seconds), ARGV[2..n] quantity for each counter
# Returns 1 when the units were given back now, 0 when the marker shows they already were.
# Setting the marker and the INCRBYs happen in one script, so a retried give-back (a task
# redelivered after its worker died) can never add the same units twice. Missing counters
# stay missing, as with STOCK_GIVE_BACK.
STOCK_GIVE_BACK_ONCE = """
if not redis.call('set', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
    return 0
end
for i = 2, #KEYS do
    if redis.call('exists', KEYS[i]) == 1 then
        redis.call('incrby', KEYS[i], ARGV[i])
    end
end
return 1
"""

_cache: weakref.WeakKeyDictionary[object, dict[str, Script]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def release_after(prelude: str) -> str:
    """A script that runs the script `prelude` and then RELEASE, in one call: `prelude` on the
    first keys and arguments, RELEASE on the last three keys (lock, queue, waiters) and the last
    two arguments (owner token, wake TTL). Answers what RELEASE answers. For a holder that has
    one more thing to tell Redis as it lets go (a copy of what it wrote under the lock): one
    round trip instead of two, and whoever gets the lock next finds it done."""
    return (
        _as_function("prelude", prelude)
        + _as_function("release", RELEASE)
        + """
local nk, na = #KEYS - 3, #ARGV - 2
prelude({unpack(KEYS, 1, nk)}, {unpack(ARGV, 1, na)})
return release({unpack(KEYS, nk + 1)}, {unpack(ARGV, na + 1)})
"""
    )


def release_each(prelude: str) -> str:
    """A script that does what `release_after(prelude)` does for each of several locks, in one
    call: for each, `prelude` on its keys and arguments, then RELEASE. ARGV[1] is the number of
    locks; then, for each, the number of `prelude`'s keys and of its arguments, its arguments,
    and RELEASE's two (owner token, wake TTL). KEYS holds, for each in turn, `prelude`'s keys and
    then RELEASE's three (lock, queue, waiters). Answers RELEASE's answer for each, in order.
    For a process that releases, with what each holder wrote, locks that other processes took:
    one round trip for all of them."""
    return (
        _as_function("prelude", prelude)
        + _as_function("release", RELEASE)
        + """
local answers = {}
local k, a = 1, 2
for n = 1, tonumber(ARGV[1]) do
    local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    a = a + 2
    prelude({unpack(KEYS, k, k + nk - 1)}, {unpack(ARGV, a, a + na - 1)})
    answers[n] = release({unpack(KEYS, k + nk, k + nk + 2)}, {unpack(ARGV, a + na, a + na + 1)})
    k, a = k + nk + 3, a + na + 2
end
return answers
"""
    )


def _as_function(name: str, source: str) -> str:
    """A script's source as a local Lua function of its KEYS and ARGV (which then shadow the
    call's own): its `return` returns from the function."""
    return f"local function {name}(KEYS, ARGV)\n{source}\nend\n"


def script_for(client: object, source: str) -> Script:
    """Return ``client.register_script(source)``, registered once per client: a `DirectScript`
    for a plain `redis.Redis` that retries nothing (what the shop builds).

    The cache holds clients weakly, so it never keeps a client (and its pool) alive.
    """
    with _cache_lock:
        scripts = _cache.setdefault(client, {})
        script = scripts.get(source)
        if script is None:
            if _direct(client):
                script = DirectScript(client, source)
            else:
                script = client.register_script(source)  # type: ignore[attr-defined]
            scripts[source] = script
        return script


def _direct(client: object) -> TypeGuard[redis.Redis]:
    """Whether `client`'s scripts may skip redis-py's command layers: a plain `redis.Redis` (no
    subclass, which may wrap its commands; no single shared connection) whose retry policy
    retries nothing, so that the retry wrapper would only ever make one attempt."""
    if type(client) is not redis.Redis or client.connection is not None:
        return False
    retry = client.get_retry()
    return retry is not None and retry.get_retries() == 0


class DirectScript(Script):
    """redis-py's `Script` for a client that `_direct` admits, sent straight down a connection
    of the client's pool: what `Redis.evalsha` does, less the layers around it that such a
    client does not use (the retry wrapper, and redis-py's telemetry hooks). A sixth to a third
    less CPU per call (`manage.py bench calls`), and the lock's and the counters' scripts are
    most of what a sale asks of Redis.

    Errors are redis-py's own: an error reply raises its `ResponseError`, a lost connection
    `ConnectionError` or `TimeoutError` (the connection is dropped, as redis-py drops it). On
    NOSCRIPT (a Redis that restarted empty), and for any other client passed in, the call goes
    through `Script.__call__`, which loads the script and runs it.
    """

    def __init__(self, client: redis.Redis, source: str) -> None:
        super().__init__(client, source)
        self._pool = client.connection_pool

    def __call__(
        self,
        keys: Sequence[Any] | None = None,
        args: Iterable[Any] | None = None,
        client: Any = None,
    ) -> Any:
        if client is not None and client is not self.registered_client:
            return super().__call__(keys, args, client)
        keys = keys or ()
        pool = self._pool
        conn = pool.get_connection()
        try:
            conn.send_command("EVALSHA", self.sha, len(keys), *keys, *(args or ()))
            return conn.read_response()
        except NoScriptError:
            pass
        finally:
            if conn.should_reconnect():
                conn.disconnect()
            pool.release(conn)
        return super().__call__(keys, args, client)
