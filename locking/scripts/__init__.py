"""How :mod:`locking` runs its Lua scripts; the scripts themselves are in the modules beside
this one, by what they serve: `lock` (the core lock and its fence), `handover` (the FIFO queue
of waiters), `counter` (the stock counters).

Every script is atomic on the server, which is the whole point: a check followed by a write
from the client would let another client slip in between the two. Each script's header says
its KEYS, its ARGV and what it returns.

Scripts are called by their SHA1 (EVALSHA), loaded again when the server answers NOSCRIPT, so
a Redis that restarted empty keeps working. See docs/design.md#locks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

#: A script call: (its source, its keys, its arguments).
ScriptCall = tuple[str, list[Any], list[Any]]

_cache: weakref.WeakKeyDictionary[object, dict[str, Script]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def as_function(name: str, source: str) -> str:
    """A script's source as a local Lua function of its KEYS and ARGV (which then shadow the
    call's own): its `return` returns from the function."""
    return f"local function {name}(KEYS, ARGV)\n{source}\nend\n"


def chain(first: ScriptCall, then: ScriptCall) -> ScriptCall:
    """One script call that runs the call `first` and then the call `then`, each on its own
    keys and arguments, and answers what `then` answers: one round trip where two would be.
    (A holder that has one more thing to tell Redis as it lets go: `LockCore.release`.)"""
    (first_source, first_keys, first_args), (source, keys, args) = first, then
    chained = (
        as_function("first", first_source)
        + as_function("then_", source)
        + f"""
local nk, na = #KEYS - {len(keys)}, #ARGV - {len(args)}
first({{unpack(KEYS, 1, nk)}}, {{unpack(ARGV, 1, na)}})
return then_({{unpack(KEYS, nk + 1)}}, {{unpack(ARGV, na + 1)}})
"""
    )
    return chained, [*first_keys, *keys], [*first_args, *args]


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
