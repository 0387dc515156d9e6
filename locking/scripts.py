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

# KEYS[1] lock name, KEYS[2] wake list
# ARGV[1] owner token, ARGV[2] wake list lifetime (ms)
# Returns 1 when the lock was ours and is now deleted, 0 otherwise (nothing changes).
# The wake list is emptied before the push so that at most one wake is ever pending:
# one release frees the lock for exactly one new owner, so waking more waiters than
# that would only make them race for it and go back to sleep. The expiry keeps a wake
# nobody consumed from lingering.
RELEASE = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
    return 0
end
redis.call('del', KEYS[1])
redis.call('del', KEYS[2])
redis.call('rpush', KEYS[2], '1')
redis.call('pexpire', KEYS[2], ARGV[2])
return 1
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
