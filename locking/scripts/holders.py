"""The scripts of units held ahead (`locking.holders.Holders`): register a holder of units taken
out of stock counters, count the holders whose lease runs, give a holder's units back unless the
counters were set since, and set the counters over the holders. Each reads and writes in one step.
See docs/decisions/0035-units-taken-ahead.md.
"""

# KEYS[1] a sale's holders (a hash: holder -> when its lease ends, ms on Redis's clock),
# KEYS[2] the generation of the sale's counters (raised each time they are set from the
# database)
# ARGV[1] holder, ARGV[2] lease (ms), ARGV[3] how long the hash is kept (ms): longer than a
# lease, so that a lease that ran out is seen (a holder that died holding units)
# Registers a holder of units taken ahead, or renews it. Returns the counters' generation
# ('0' when none was set), which a give-back of the units then names. Redis's own clock, so
# that holders on hosts whose clocks differ agree.
HOLDER_REGISTER = """
local now = redis.call('time')
local ends = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[2])
redis.call('hset', KEYS[1], ARGV[1], ends)
if redis.call('pttl', KEYS[1]) < tonumber(ARGV[3]) then
    redis.call('pexpire', KEYS[1], ARGV[3])
end
return redis.call('get', KEYS[2]) or '0'
"""

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
# generation moved: the database counted the units) or Redis lost them: then nothing is added,
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
STOCK_SET_OVER_HOLDERS = """
redis.call('del', KEYS[1])
redis.call('incr', KEYS[2])
for i = 3, #KEYS do
    redis.call('set', KEYS[i], ARGV[i - 2])
end
return #KEYS - 2
"""
