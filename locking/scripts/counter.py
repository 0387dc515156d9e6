"""The stock counters' scripts (`locking.counter.StockCounter`): take units without ever going
below zero, take them spread over an item's stock rows, give them back once, copy a row's level
only if newer, and pick a free shard holding the quantity and lock it. Each reads and writes in
one step, so concurrent takers cannot oversell. See docs/design.md#where-the-units-live.
"""

from .holders import REGISTER_FUNCTIONS
from .lock import FENCE_FUNCTIONS, RELEASE

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
# A take may register a holder of the units it takes (units taken ahead,
# docs/decisions/0035-units-taken-ahead.md) before it takes them, in the same step: its units
# are then sure to be taken under a live registration, in the generation it returns.
# KEYS: per group, its cursor and then its n stock counters; after the groups, per take in
# order, its idempotency claim when it has one, then the holders hash and the counters'
# generation when it registers a holder.
# ARGV[1] the number of groups g, ARGV[2..g+1] each group's n; then, seven per take: its group
# (from 1), the quantity, the claim's TTL in ms and the taker's token (both "" without a
# claim), the holder, its lease in ms and how long the hash is kept in ms (all three "" when
# it registers none).
# Returns, per take, the length of its reply and then the reply STOCK_TAKE_SPREAD gives, and
# for a take that registers a holder, the counters' generation after it.
STOCK_TAKE_SPREAD_MANY = (
    _TAKE_SPREAD_FUNCTION
    + REGISTER_FUNCTIONS
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
for a = groups + 2, #ARGV, 7 do
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
    local generation
    if ARGV[a + 4] ~= '' then
        generation = register(KEYS[k], KEYS[k + 1], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6])
        k = k + 2
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
    if generation then
        out[#out + 1] = generation
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
    FENCE_FUNCTIONS
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
DELETE_IF_EQUAL = RELEASE  # the core lock's release is exactly this

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
