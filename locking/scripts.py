"""Lua sources used by :mod:`locking`, as named constants, plus a per-client cache.

Every script is atomic on the server, which is the whole point: a check followed by a
write from the client would let another client slip in between the two.

Scripts are loaded with ``register_script`` (EVALSHA, falling back to EVAL when the
server answers NOSCRIPT), so a Redis that restarted empty keeps working.
"""

from __future__ import annotations

import threading
import weakref

from redis.commands.core import Script

# The lock's helper keys, all derived from the lock name:
#   <name>:queue          list of waiting tokens, oldest first (FIFO order)
#   <name>:waiters        hash token -> "<deadline ms> <ttl ms>" for every queued token
#   <name>:wake:<token>   one waiter's wake: the release that hands it the lock pushes here
# A token is in the list exactly when it is in the hash; every script below changes both
# together. The deadline is Redis server time (TIME), so waiters' clocks do not matter.
# The list and the hash share one expiry, never shorter than the latest deadline of an
# entry; a wake key lives a few seconds. Nothing outlives the waiters that created it.
# TIME followed by writes needs effects replication, the default since Redis 5 (and the
# only mode since 7), so no script calls redis.replicate_commands().
# The release script builds the next waiter's wake key from the lock name, a key it is not
# passed in KEYS: the scripts suit a single Redis (or one with all keys on one node), not a
# Redis Cluster.

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters, KEYS[4] this waiter's wake key
# ARGV[1] owner token, ARGV[2] lock TTL in ms ("0": none),
# ARGV[3] how long a queue entry stays valid, in ms ("0": take the lock if free, never queue)
# Returns {1, 0} when the lock is ours: it was free and is now set to ARGV[1], or it
# already held ARGV[1] (handed over to us, or an earlier run of this very call, whose reply
# was lost, took it). Our queue entry and wake are dropped then.
# Otherwise returns {0, PTTL of the lock} and, when ARGV[3] > 0, makes sure ARGV[1] is
# queued: appended at the tail the first time, its deadline (TIME + ARGV[3]) refreshed in
# place on later calls, so one acquisition never holds two places.
# A free lock is taken even when others are queued (it only happens when the last holder's
# lock expired, or no queued entry was still valid at its release): queued waiters are
# woken no later than the expiry and retry, so nobody waits forever.
TAKE_OR_QUEUE = """
local held = redis.call('get', KEYS[1])
if held and held ~= ARGV[1] then
    local ttl = redis.call('pttl', KEYS[1])
    local valid = tonumber(ARGV[3])
    if valid > 0 then
        local now = redis.call('time')
        local deadline = now[1] * 1000 + math.floor(now[2] / 1000) + valid
        local entry = string.format('%.0f %s', deadline, ARGV[2])
        if redis.call('hset', KEYS[3], ARGV[1], entry) == 1 then
            redis.call('rpush', KEYS[2], ARGV[1])
        end
        local keep = math.max(valid, redis.call('pttl', KEYS[2]))
        redis.call('pexpire', KEYS[2], keep)
        redis.call('pexpire', KEYS[3], keep)
    end
    return {0, ttl}
end
if not held then
    if ARGV[2] == '0' then
        redis.call('set', KEYS[1], ARGV[1])
    else
        redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
    end
end
if redis.call('hdel', KEYS[3], ARGV[1]) == 1 then
    redis.call('lrem', KEYS[2], 1, ARGV[1])
end
redis.call('del', KEYS[4])
return {1, 0}
"""

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters
# ARGV[1] owner token, ARGV[2] wake key lifetime (ms)
# Returns 0 when the lock does not hold ARGV[1]: the lock is left untouched, only a queue
# entry of ARGV[1] is withdrawn (a token whose acquisition failed midway must not be
# handed the lock later). Otherwise:
# * hands the lock over: pops the queue head, skipping entries whose deadline (server
#   TIME) has passed, sets the lock to that waiter's token with that waiter's TTL, pushes
#   the waiter's own wake and returns 2. The waiter owns the lock from this moment on,
#   without a round trip of its own; a waiter that died while queued is handed the lock
#   all the same, which then expires after its TTL like a crashed holder's.
# * deletes the lock when no valid entry is queued, and returns 1.
RELEASE = """
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
        local ttl = string.sub(entry, space + 1)
        if tonumber(string.sub(entry, 1, space - 1)) > now then
            if ttl == '0' then
                redis.call('set', KEYS[1], waiter)
            else
                redis.call('set', KEYS[1], waiter, 'PX', ttl)
            end
            local wake = KEYS[1] .. ':wake:' .. waiter
            redis.call('rpush', wake, '1')
            redis.call('pexpire', wake, ARGV[2])
            return 2
        end
    end
end
redis.call('del', KEYS[1])
return 1
"""

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters, KEYS[4] this waiter's wake key
# ARGV[1] owner token
# A waiter giving up. Returns 1 when the lock holds ARGV[1] (a release handed it over
# just now): the waiter keeps it. Returns 0 otherwise. Either way the waiter's queue entry
# and wake are gone afterwards, so no later release can hand it the lock: whatever this
# script answers is final.
CANCEL = """
if redis.call('hdel', KEYS[3], ARGV[1]) == 1 then
    redis.call('lrem', KEYS[2], 1, ARGV[1])
end
redis.call('del', KEYS[4])
if redis.call('get', KEYS[1]) == ARGV[1] then
    return 1
end
return 0
"""

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

# KEYS[1] cursor (an integer key, created at 1 on first use), KEYS[2..n+1] the stock counters
# of one item's n stock rows (index i is KEYS[i + 2])
# ARGV[1] quantity (positive integer)
# Returns {-2} when any counter does not exist, {-1, units left in all} when the counters
# together hold less than the quantity (nothing changed then), otherwise the units taken as a
# flat list {index, units, index, units, ...}: from one counter that holds the whole quantity
# when one does (the first such counter at or after the cursor's position, so that takers
# spread over the rows in turn), else from several, lowest index first. Every counter is read
# and decremented in the one script, so concurrent takers cannot oversell any of them.
STOCK_TAKE_SPREAD = """
local n = #KEYS - 1
local qty = tonumber(ARGV[1])
local levels = redis.call('mget', unpack(KEYS, 2))
local total = 0
for i = 1, n do
    if not levels[i] then
        return {-2}
    end
    local level = tonumber(levels[i])
    if not level then
        return redis.error_reply('stock counter ' .. KEYS[i + 1] .. ' does not hold an integer')
    end
    levels[i] = level
    total = total + level
end
if total < qty then
    return {-1, total}
end
local start = redis.call('incr', KEYS[1]) % n
for step = 0, n - 1 do
    local i = (start + step) % n + 1
    if levels[i] >= qty then
        redis.call('decrby', KEYS[i + 1], qty)
        return {i - 1, qty}
    end
end
local taken = {}
local needed = qty
for i = 1, n do
    if needed > 0 and levels[i] > 0 then
        local units = math.min(levels[i], needed)
        redis.call('decrby', KEYS[i + 1], units)
        taken[#taken + 1] = i - 1
        taken[#taken + 1] = units
        needed = needed - units
    end
end
return taken
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


def script_for(client: object, source: str) -> Script:
    """Return ``client.register_script(source)``, registered once per client.

    The cache holds clients weakly, so it never keeps a client (and its pool) alive.
    """
    with _cache_lock:
        scripts = _cache.setdefault(client, {})
        script = scripts.get(source)
        if script is None:
            script = client.register_script(source)  # type: ignore[attr-defined]
            scripts[source] = script
        return script
