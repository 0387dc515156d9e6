"""The FIFO hand-over's scripts (`locking.handover.FifoHandOver`): queue a waiter, hand the lock
to the first waiter on release, withdraw a waiter that gives up. A waiter is granted the lock
by the release itself, in the order waiters queued. See docs/design.md#locks.

Keys, beside the lock's own (`locking.scripts.lock`), all derived from the lock name:
``<name>:queue`` lists the waiting tokens, oldest first; ``<name>:waiters`` maps each queued
token to ``"<deadline ms> <ttl ms>[ <wake list>]"``; ``<name>:wake:<token>`` is one waiter's
wake, onto which the release that hands it the lock pushes its fence (or, for a waiter whose
entry names a wake list, a process's wake hub, ``"<token> <fence>"`` goes onto that list).
Invariants: a token is in the list exactly when it is in the hash (every script changes both);
the deadline is Redis server time, so waiters' clocks do not matter; the list and the hash
share one expiry, never shorter than the latest deadline; a wake key lives a few seconds.
The release builds a waiter's wake key from the lock name: on a Redis Cluster the name's hash
tag keeps it in the lock's slot (a wake hub's list is for a single Redis only).
"""

from . import as_function
from .lock import FENCE_FUNCTIONS, TAKE

# KEYS[1] lock name, KEYS[2] queue, KEYS[3] waiters, KEYS[4] this waiter's wake key
# ARGV[1] owner token, ARGV[2] lock TTL in ms ("0": none),
# ARGV[3] how long a queue entry stays valid, in ms ("0": take the lock if free, never queue),
# ARGV[4] the list a release that hands us the lock pushes our wake onto ("": our own wake key)
# Returns what TAKE returns. When the lock is ours, our queue entry and wake are dropped.
# Otherwise, when ARGV[3] > 0, makes sure ARGV[1] is queued: appended at the tail the first
# time, its deadline (TIME + ARGV[3]) refreshed in place on later calls, so one acquisition
# never holds two places.
# A free lock is taken even when others are queued (it only happens when the last holder's
# lock expired, or no queued entry was still valid at its release): queued waiters are
# woken no later than the expiry and retry, so nobody waits forever.
TAKE_OR_QUEUE = (
    as_function("take", TAKE)
    + """
local taken = take({KEYS[1]}, {ARGV[1], ARGV[2]})
if taken[1] == 1 then
    if redis.call('hdel', KEYS[3], ARGV[1]) == 1 then
        redis.call('lrem', KEYS[2], 1, ARGV[1])
    end
    redis.call('del', KEYS[4])
    return taken
end
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
return taken
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
#   the wake list its entry names, read as `locking.wakes.HandOver`) and returns 2. The waiter
#   owns the lock from this moment on, without a round trip of its own; a waiter that died
#   while queued is handed the lock all the same, which then expires after its TTL like a
#   crashed holder's.
# * deletes the lock when no valid entry is queued, and returns 1.
HAND_OVER = (
    FENCE_FUNCTIONS
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
    FENCE_FUNCTIONS
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


def release_each(prelude: str) -> str:
    """A script that does what `chain((prelude, ...), (HAND_OVER, ...))` does for each of several
    locks, in one call: for each, `prelude` on its keys and arguments, then HAND_OVER. ARGV[1] is
    the number of locks; then, for each, the number of `prelude`'s keys and of its arguments, its
    arguments, and HAND_OVER's two (owner token, wake TTL). KEYS holds, for each in turn,
    `prelude`'s keys and then HAND_OVER's three (lock, queue, waiters). Answers HAND_OVER's answer
    for each, in order. For a process that releases, with what each holder wrote, locks that
    other processes took: one round trip for all of them."""
    return (
        as_function("prelude", prelude)
        + as_function("release", HAND_OVER)
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
