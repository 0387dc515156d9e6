"""The scripts of units held ahead (`locking.holders.Holders`): register a holder of units taken
out of stock counters, count the holders whose lease runs, give a holder's units back unless the
counters were set since, and set the counters over the holders. Each reads and writes in one step.
See docs/decisions/0035-units-taken-ahead.md.
"""

# Lua functions shared by the scripts that register a holder (prefixed to their text).
# register(holders, generation, holder, lease, keep) registers `holder` in the hash `holders`
# (holder -> when its lease ends, ms on Redis's own clock, so that holders on hosts whose clocks
# differ agree) for `lease` ms, or renews it, keeps the hash `keep` ms after (longer than a
# lease, so that a lease that ran out is seen: a holder that died holding units), and returns
# the counters' generation, which a give-back of the units then names.
# A generation is started when there is none (a sale never set, or a Redis that restarted
# empty) from Redis's clock, and moved by one (`next_generation`) each time the counters are set
# from the database: a generation is never seen twice, not even across a Redis that lost its
# keys, so units taken before are never given back into counters rebuilt since.
REGISTER_FUNCTIONS = """
local function fresh_generation(generation)
    local now = redis.call('time')
    local started = now[1] .. string.format('%06d', tonumber(now[2]))
    redis.call('set', generation, started)
    return started
end
local function current_generation(generation)
    return redis.call('get', generation) or fresh_generation(generation)
end
local function next_generation(generation)
    if redis.call('exists', generation) == 1 then
        return redis.call('incr', generation)
    end
    return fresh_generation(generation)
end
local function register(holders, generation, holder, lease, keep)
    local now = redis.call('time')
    local ends = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(lease)
    redis.call('hset', holders, holder, ends)
    if redis.call('pttl', holders) < tonumber(keep) then
        redis.call('pexpire', holders, keep)
    end
    return current_generation(generation)
end
"""

# KEYS[1] a sale's holders, KEYS[2] the generation of the sale's counters
# ARGV[1] holder, ARGV[2] lease (ms), ARGV[3] how long the hash is kept (ms)
# Registers a holder of units taken ahead, or renews it (`register`, above). Returns the
# counters' generation. A take that holds its units registers in its own script instead
# (`STOCK_TAKE_SPREAD_MANY`): the units are then sure to be taken under a registration.
HOLDER_REGISTER = (
    REGISTER_FUNCTIONS
    + """
return register(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
"""
)

# KEYS[1] a sale's holders
# ARGV[1] a holder to leave out ('' for none), ARGV[2] '1' to remove the registrations whose
# lease ran out
# Returns {holders whose lease runs, holders whose lease ran out}. A lease that ran out is a
# holder that died, or stopped, holding units it never gave back.
HOLDERS_COUNT = """
local now = redis.call('time')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local entries = redis.call('hgetall', KEYS[1])
local live, ended = 0, 0
for i = 1, #entries, 2 do
    if tonumber(entries[i + 1]) <= ms then
        ended = ended + 1
        if ARGV[2] == '1' then
            redis.call('hdel', KEYS[1], entries[i])
        end
    elseif entries[i] ~= ARGV[1] then
        live = live + 1
    end
end
return {live, ended}
"""

# KEYS[1] a sale's holders, KEYS[2] the counters' generation, KEYS[3..n] stock counters
# ARGV[1] holder, ARGV[2] the generation its units were taken in, ARGV[3..n] quantity for each
# counter
# Ends the holder's registration and gives its units back to the counters, in one script.
# Returns 1 when they went back, 0 when the counters were set from the database since (their
# generation moved: the database counted the units) or Redis lost them (a generation started
# since, or none): then nothing is added,
# so no unit is counted twice. Missing counters stay missing, as with STOCK_GIVE_BACK.
STOCK_GIVE_BACK_HELD = """
redis.call('hdel', KEYS[1], ARGV[1])
if (redis.call('get', KEYS[2]) or '0') ~= ARGV[2] then
    return 0
end
for i = 3, #KEYS do
    if redis.call('exists', KEYS[i]) == 1 then
        redis.call('incrby', KEYS[i], ARGV[i])
    end
end
return 1
"""

# KEYS[1] a sale's holders, KEYS[2] the counters' generation, KEYS[3..n] stock counters
# ARGV[1..n-2] each counter's value
# Sets the counters from the system of record, which counts the units holders took ahead:
# every registration ends and the generation moves, in the same step, so that none of those
# units is given back on top (STOCK_GIVE_BACK_HELD).
STOCK_SET_OVER_HOLDERS = (
    REGISTER_FUNCTIONS
    + """
redis.call('del', KEYS[1])
next_generation(KEYS[2])
for i = 3, #KEYS do
    redis.call('set', KEYS[i], ARGV[i - 2])
end
return #KEYS - 2
"""
)
