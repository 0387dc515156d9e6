"""The core lock's scripts (`locking.core.LockCore`): take with a fencing token, release,
extend. Each compares the owner token and writes in one step, so only the holder of the token
stored under the lock's name can release or extend it. See docs/design.md#locks.

Keys, all derived from the lock name: ``<name>`` holds the owner token; ``<name>:fence`` the
fencing token of the lock's latest grant (`FENCE_FUNCTIONS`). Scripts build the fence key from
the name inside Lua: on a Redis Cluster the name carries a hash tag so that both share a slot.
"""

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
# TIME followed by writes needs effects replication, the default since Redis 5 (and the only
# mode since 7), so no script calls redis.replicate_commands().
FENCE_FUNCTIONS = """
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

# KEYS[1] lock name
# ARGV[1] owner token, ARGV[2] lock TTL in ms ("0": none)
# Returns {1, 0, fence} when the lock is ours: it was free and is now set to ARGV[1] (SET NX PX,
# a new grant: fence is its fencing token), or it already held ARGV[1] (an earlier run of this
# very call, whose reply was lost, took it, or a hand-over gave it: fence is that grant's).
# Returns {0, PTTL of the lock} when another token holds it.
TAKE = (
    FENCE_FUNCTIONS
    + """
local held = redis.call('get', KEYS[1])
if held and held ~= ARGV[1] then
    return {0, redis.call('pttl', KEYS[1])}
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
return {1, 0, fence}
"""
)

# KEYS[1] lock name (or any key), ARGV[1] owner token (or any value)
# Deletes the key if it holds the value: returns 1, else 0 (the key is left alone).
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
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
