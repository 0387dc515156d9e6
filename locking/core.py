"""The lock's core: redis-py's lock (SET NX PX, an owner token, compare-and-delete release,
extend) plus a fencing token for every grant. `locking.Lock` is this core with its features
composed around it (`handover`, `watchdog`, `reentrant`, `replicas`): each overrides hooks of
the core (``_grant``, ``_held``, ``_letting_go``, ``_release_call``) or wraps ``acquire`` and
``release``.

Invariants: at most one token is stored under the lock's name; only the holder of that token
releases or extends it; every grant's fence is greater than every earlier grant's of the name.
See docs/design.md#locks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from types import SimpleNamespace, TracebackType
from typing import Any, Literal, Self

from redis.exceptions import LockError, LockNotOwnedError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .cluster import has_hash_tag, is_cluster
from .scripts import ScriptCall, chain, script_for
from .scripts import lock as lock_scripts

logger = logging.getLogger(__name__)

Number = int | float


class _Holding(threading.local):
    """This thread's token and fence; the class attributes are every new thread's defaults."""

    token: bytes | None = None
    fence: int | None = None


class ContextManaged:
    """`with lock:` as redis-py's: acquire (LockError if not within the time given), release
    on the way out, a release that finds the lock gone raising only if
    `raise_on_release_error`. For the classes here that have `acquire`, `release`, `name`."""

    name: str
    raise_on_release_error: bool

    def acquire(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        if self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified", lock_name=self.name)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockError:
            if self.raise_on_release_error:
                raise
            logger.warning(
                "Lock %r was no longer owned when exiting the context manager", self.name
            )


class LockCore(ContextManaged):
    """A distributed lock stored in Redis under ``name``; API of :class:`redis.lock.Lock`.

    Contract:

    * At most one token is stored under ``name`` at a time, and only the holder of that token
      can release, extend or reacquire the lock (compare-and-delete, compare-and-pexpire in
      Lua); anyone else gets :class:`~redis.exceptions.LockNotOwnedError` and the key is left
      untouched.
    * A free lock is taken with ``SET NX PX`` (`scripts.lock.TAKE`). A blocking ``acquire``
      tries again every ``sleep`` seconds until ``blocking_timeout`` has passed (``None``:
      forever), as redis-py's does; `locking.handover` replaces the polling with a queue.
    * ``fence`` is the fencing token of the current acquisition (None when not held): it is
      greater than the fence of every earlier grant of this lock name, so a guarded write that
      records the greatest fence it accepted (``... WHERE fence <= %(fence)s``) refuses an
      earlier holder that woke up late. It is ``max(last + 1, the Redis server's time in
      microseconds)``, so it keeps growing after Redis restarted empty, as long as the server's
      clock did not step back across the restart.
    * A take that times out on the client may still run on the server: a ``GET`` then decides
      whether the lock is ours. Other Redis failures propagate to the caller.
    * ``timeout`` (seconds) is the lock's TTL; ``None`` means none. The lock simply expires
      after it, even if the holder is still working: check :meth:`owned` or
      :meth:`ensure_held` before committing work.
    * ``thread_local=True`` keeps the token per thread, as in redis-py.
    * On a Redis Cluster the name must carry a hash tag (``lock:{item:1}``): the scripts build
      the fence key (and a hand-over's keys) from the name inside Lua.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        timeout: Number | None = None,
        sleep: Number = 0.1,
        blocking: bool = True,
        blocking_timeout: Number | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
    ) -> None:
        if is_cluster(redis) and not has_hash_tag(name):
            raise ValueError(
                f"lock name {name!r} has no hash tag: on a Redis Cluster its helper keys "
                "(fence, queue, waiters, wakes) must share its slot, e.g. 'lock:{item:1}'"
            )
        self.redis = redis
        self.name = name
        self.timeout = timeout
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.raise_on_release_error = raise_on_release_error
        # Built from the encoded name, as the scripts build it from KEYS[1].
        self._fence_name = redis.get_encoder().encode(name) + b":fence"
        self.local: Any = _Holding() if self.thread_local else SimpleNamespace()
        self.local.token = None
        self.local.fence = None

    # -- acquisition -----------------------------------------------------------------

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Take the lock; return True once it is ours, False if we gave up.

        ``token`` (str or bytes) replaces the random uuid4 owner token; the other arguments
        override the constructor's for this call.
        """
        if token is None:
            token_bytes = uuid.uuid4().hex.encode()
        else:
            token_bytes = self.redis.get_encoder().encode(token)
        fence = self._grant(
            token_bytes,
            self.blocking if blocking is None else blocking,
            self.blocking_timeout if blocking_timeout is None else blocking_timeout,
            self.sleep if sleep is None else sleep,
        )
        if fence is None:
            return False
        self._held(token_bytes, fence)
        return True

    def _grant(
        self, token: bytes, blocking: bool, blocking_timeout: Number | None, sleep: Number
    ) -> int | None:
        """Take the lock for ``token``: the fence of the grant, or None if we gave up.

        Here redis-py's loop: one take, then one every ``sleep`` seconds while blocking, until
        the next would come after ``blocking_timeout``."""
        stop_at = None if blocking_timeout is None else time.monotonic() + blocking_timeout
        while True:
            acquired, _, fence = self._take(token)
            if acquired:
                return fence
            if not blocking or (stop_at is not None and time.monotonic() + sleep > stop_at):
                return None
            time.sleep(sleep)

    def _take(self, token: bytes) -> tuple[bool, int, int | None]:
        """One take (`scripts.lock.TAKE`): (acquired, PTTL of the lock when not acquired, the
        fence when acquired)."""
        try:
            acquired, pttl, *fence = script_for(self.redis, lock_scripts.TAKE)(
                keys=[self.name], args=[token, self._ttl_ms() or 0], client=self.redis
            )
            return bool(acquired), int(pttl), int(fence[0]) if acquired else None
        except RedisTimeoutError:
            # The client gave up waiting, but the script may have run (or may still run) on
            # the server: only the stored value tells whether the lock is ours.
            return self._read_back(token)

    def _read_back(self, token: bytes) -> tuple[bool, int, int | None]:
        """What `_take` answers, read from the keys after a take whose reply was lost."""
        # If this read fails the error propagates: Redis is unusable for now.
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.name)
        pipe.pttl(self.name)
        pipe.get(self._fence_name)
        stored, pttl, fence = pipe.execute()
        if self._is_token(stored, token):
            # The lock holds our token, so its latest grant, and fence, was ours.
            return True, 0, int(fence or 0)
        return False, int(pttl), None

    def _held(self, token: bytes, fence: int | None) -> None:
        """Record an acquisition with ``token`` and its ``fence``."""
        self.local.token = token
        self.local.fence = fence

    def adopt(self, token: str | bytes, fence: int | None = None) -> None:
        """Hold the lock as if ``acquire`` had just taken it with ``token``.

        For a caller whose own script took the lock (``SET name token NX PX`` with this
        lock's TTL, and the grant's fencing token, ``fence``) in the same step as something
        else, e.g. choosing which of several locks to take. ``release``, ``owned``, ``fence``
        (and a watchdog) then work as after ``acquire``.
        """
        self._held(self.redis.get_encoder().encode(token), fence)

    # -- state -----------------------------------------------------------------------

    def locked(self) -> bool:
        """True if anyone holds the lock (one GET)."""
        return self.redis.get(self.name) is not None

    def owned(self) -> bool:
        """True if this lock's token (in this thread) is the one stored (one GET)."""
        return self._is_token(self.redis.get(self.name), self.local.token)

    @property
    def fence(self) -> int | None:
        """The fencing token of the current acquisition (in this thread), None when not held."""
        return self.local.fence

    @property
    def lost(self) -> bool:
        """Whether something watching the lock found it gone: never, here (`locking.watchdog`
        watches)."""
        return False

    def ensure_held(self) -> None:
        """Raise LockNotOwnedError unless the lock is still ours (checks ``lost``, then one GET).

        Call it right before committing work done under the lock.
        """
        if self.lost or not self.owned():
            raise LockNotOwnedError("The lock is no longer owned", lock_name=self.name)

    def _is_token(self, stored: Any, token: bytes | None) -> bool:
        if stored is None or token is None:
            return False
        if not isinstance(stored, bytes):
            stored = self.redis.get_encoder().encode(stored)
        return stored == token

    def _ttl_ms(self) -> int | None:
        if not self.timeout:
            return None
        return max(1, int(self.timeout * 1000))

    # -- release / TTL ---------------------------------------------------------------

    def release(self, *, after: ScriptCall | None = None) -> None:
        """Release the lock.

        ``after``: (a script's source, its keys, its arguments) to run first, in the same call
        to Redis (`scripts.chain`): one round trip where two would be, and the next holder
        finds its effect. It runs whether or not the lock is still ours. On a cluster its keys
        must share the lock's slot.

        Raises LockError if this lock was not acquired, LockNotOwnedError if it has been taken
        over or has expired meanwhile (then the lock is left alone).
        """
        expected = self.local.token
        if expected is None:
            raise LockError(
                "Cannot release a lock that's not owned or is already unlocked.",
                lock_name=self.name,
            )
        self.local.token = None
        self.local.fence = None
        self._letting_go()
        call = self._release_call(expected)
        source, keys, args = call if after is None else chain(after, call)
        if not script_for(self.redis, source)(keys=keys, args=args, client=self.redis):
            raise LockNotOwnedError(
                "Cannot release a lock that's no longer owned", lock_name=self.name
            )

    def _release_call(self, token: bytes) -> ScriptCall:
        """The script call that releases the lock held with ``token``: truthy when it did."""
        return lock_scripts.RELEASE, [self.name], [token]

    def _letting_go(self) -> None:
        """Called as the current acquisition ends, before Redis is told."""

    def released_elsewhere(self) -> None:
        """Forget the current acquisition without a call to Redis: another process has
        released the lock with its token (`release_each_call`), e.g. the one that committed the
        work done under it. Raises LockError if this lock was not acquired."""
        if self.local.token is None:
            raise LockError("Only a lock held can be released elsewhere", lock_name=self.name)
        self.local.token = None
        self.local.fence = None
        self._letting_go()

    def extend(self, additional_time: Number, replace_ttl: bool = False) -> Literal[True]:
        """Add ``additional_time`` seconds to the TTL (or set it, with ``replace_ttl``).

        Raises LockError if not acquired or without a timeout, LockNotOwnedError if
        the lock is not ours any more.
        """
        if self.local.token is None:
            raise LockError("Cannot extend an unlocked lock", lock_name=self.name)
        if self.timeout is None:
            raise LockError("Cannot extend a lock with no timeout", lock_name=self.name)
        if not self._pexpire(self.local.token, int(additional_time * 1000), replace_ttl):
            raise LockNotOwnedError(
                "Cannot extend a lock that's no longer owned", lock_name=self.name
            )
        return True

    def reacquire(self) -> Literal[True]:
        """Reset the TTL to ``timeout``; same errors as :meth:`extend`."""
        if self.local.token is None:
            raise LockError("Cannot reacquire an unlocked lock", lock_name=self.name)
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout", lock_name=self.name)
        if not self._pexpire(self.local.token, self._ttl_ms() or 0, True):
            raise LockNotOwnedError(
                "Cannot reacquire a lock that's no longer owned", lock_name=self.name
            )
        return True

    def _pexpire(self, token: bytes, ms: int, replace_ttl: bool, client: Any = None) -> Any:
        """Set (``replace_ttl``) or lengthen the TTL if the lock holds ``token``: truthy when it
        did (`scripts.lock.EXTEND`). ``client``: a pipeline to queue it on instead."""
        return script_for(self.redis, lock_scripts.EXTEND)(
            keys=[self.name],
            args=[token, ms, "1" if replace_ttl else "0"],
            client=self.redis if client is None else client,
        )
