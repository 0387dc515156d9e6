"""A Redis lock with the API of :class:`redis.lock.Lock`, FIFO handoff and a watchdog.

Differences from redis-py's lock, all invisible to code written against redis-py:

* Waiters do not poll, and a release hands the lock straight to the longest waiter.
  A blocking ``acquire`` runs one script that takes the lock if it is free or else
  appends the caller's token to the lock's FIFO queue, then blocks in ``BLPOP`` on a
  wake key of its own. The release script does not delete the lock while a waiter is
  queued: it sets the lock to the first waiter's token, with that waiter's TTL, and
  pushes that waiter's wake. The woken waiter owns the lock without another round trip,
  and no newcomer can take it in between. Each wait is capped by the lock's remaining
  TTL, so a lock whose holder died is taken as soon as it expires (a wait shorter than
  Redis' timer tick is slept on the client: the server ends a BLPOP late by up to a tick).
* A ``SET`` or a script that times out on the client may still run on the server; a
  ``GET`` then decides whether the lock is ours.
* Every grant hands out a fencing token, :attr:`Lock.fence`: a number that grows with each
  grant of the lock's name, across holders, processes and Redis restarts. A store written
  under the lock that refuses tokens older than the newest it has accepted cannot be written
  by a holder that was paused past its TTL (a GC pause, SIGSTOP, a swapped-out VM): the
  watchdog cannot help there, it was paused too.
* An optional watchdog keeps the TTL short while the holder is alive and reports,
  through :attr:`Lock.lost` and ``on_lost``, when the lock slipped away. Its thread is
  started only once the lock has been held for one renewal interval (``timeout / 3``):
  a short critical section, the common case, never creates or joins a thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from types import SimpleNamespace, TracebackType
from typing import Any, Literal

from redis.exceptions import LockError, LockNotOwnedError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .cluster import has_hash_tag, is_cluster
from .scripts import ScriptCall, chain, script_for
from .scripts import handover as handover_scripts
from .scripts import lock as lock_scripts
from .wakes import WakeHub, hub_for

logger = logging.getLogger(__name__)

Number = int | float

#: Lifetime of a wake nobody consumed; long enough for a waiter that is between its
#: queueing script and its BLPOP to still find it, short enough that nothing lingers.
WAKE_TTL_MS = 3000

#: How long a queue entry outlives the wait slice its waiter is blocked for. A live waiter
#: renews its entry after every slice, so this only needs to cover one round trip and some
#: scheduling delay; past it, a release skips the entry (its waiter is dead, or so late that
#: it will queue again, at the tail). It bounds how long after a waiter died a release can
#: still hand the dead waiter the lock.
QUEUE_GRACE_MS = 1000

#: Told of every watchdog renewal of this process's locks: called as ``listener(lock, renewed)``
#: from the watchdog's thread, ``renewed`` False when the renewal failed and the lock is taken
#: for lost (an application's metrics, say). A listener that raises is logged and ignored.
watchdog_listeners: list[Callable[[Lock, bool], object]] = []

#: BLPOP treats 0 as "block forever"; every wait is clamped to at least this.
MIN_WAIT = 0.001

#: Wait slice when the client has no socket timeout.
DEFAULT_MAX_WAIT_SLICE = 1.0

#: Redis ends a blocked BLPOP on its timer tick (every 100 ms at the default ``hz 10``) unless
#: other traffic wakes it first: on a quiet server a BLPOP of 20 ms returns after up to 100. A
#: wait shorter than this (the lock expires sooner, or the caller gives up sooner) is slept on
#: the client instead, so that a waiter takes an expired lock on time; a hand-over meanwhile
#: is found by the next script, which sees the lock holding the waiter's token.
SERVER_TICK = 0.1


class _Lease:
    """One acquisition: its token and, with a watchdog, the thread renewing it."""

    __slots__ = ("token", "stop", "thread", "lost", "state_lock")

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.lost = False
        # Serialises "release stops the watchdog" with "watchdog declares the lock
        # lost" and with "the scheduler starts the watchdog's thread", so a renewal
        # failing because of our own release is not reported, and no thread starts
        # for a lease that is already released.
        self.state_lock = threading.Lock()


class _Reentries(threading.local):
    """This thread's reentrant holds: (client's pool, lock name) -> [token, times taken]."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], list[Any]] = {}


_reentries = _Reentries()


class _ThreadState(threading.local):
    """Per-thread token and lease; the class attributes are every new thread's defaults."""

    token: bytes | None = None
    lease: _Lease | None = None
    fence: int | None = None


class Lock:
    """A distributed lock stored in Redis under ``name``; API of :class:`redis.lock.Lock`.

    Contract:

    * At most one token is stored under ``name`` at a time, and only the holder of that
      token can release, extend or reacquire the lock (Lua compare-and-delete /
      compare-and-pexpire); anyone else gets :class:`~redis.exceptions.LockNotOwnedError`
      and the key is left untouched.
    * A free lock is taken with ``SET NX``. A blocking ``acquire`` that finds it taken
      queues its token in ``<name>:queue`` (FIFO; details in ``<name>:waiters``) and waits
      on ``<name>:wake:<token>``. ``release`` hands the lock to the first queued waiter
      that is still waiting (it sets the lock to that waiter's token, with that waiter's
      ``timeout``), or deletes it when none is. Waiters therefore get the lock in the
      order they queued. A newcomer only takes the lock when it is free, which with
      waiters queued happens only after the lock expired: the queued waiters wake by then
      and compete for it too, so nobody starves.
    * A waiter that gives up (``blocking_timeout``) withdraws from the queue in one
      script; if a release handed it the lock just before, it keeps the lock and
      ``acquire`` returns True. A lock is never left to a waiter whose ``acquire``
      returned False.
    * A waiter that dies while queued may still be handed the lock, for up to
      ``max_wait_slice`` + 1 s after its death (its queue entry is renewed by the living
      waiter after every wait slice, and skipped once it is that stale). That lock then
      expires after the dead waiter's ``timeout``, exactly like the lock of a holder that
      crashed; without a ``timeout`` it never does.
    * Tokens must be unique per acquisition (the default uuid4 tokens are): a queued
      token is how a release finds its waiter.
    * ``fence`` is the fencing token of the current acquisition (None when not held): it is
      greater than the fence of every earlier grant of this lock name, so a guarded write
      that records the greatest fence it accepted (``... WHERE fence <= %(fence)s``) refuses
      an earlier holder that woke up late. It is ``max(last + 1, the Redis server's time in
      microseconds)``, so it keeps growing after Redis restarted empty, as long as the
      server's clock did not step back across the restart; a reentrant acquisition keeps
      the first one's fence.
    * ``timeout`` (seconds) is the lock's TTL. Without a watchdog the lock simply
      expires after it, even if the holder is still working: check :meth:`owned` or
      :meth:`ensure_held` before committing work. ``None`` means no TTL.
    * ``blocking``/``blocking_timeout`` behave as in redis-py: ``acquire`` returns False
      once ``blocking_timeout`` seconds have passed (``None``: wait forever). A
      non-blocking ``acquire`` runs a single script (``SET NX`` and the fence) and never
      queues.
    * ``sleep`` is accepted for compatibility only: waiting is event-driven (BLPOP on the
      waiter's own wake key), so no poll interval delays an acquisition.
    * ``max_wait_slice`` bounds a single BLPOP, which bounds the delay when a wake is
      missed. Default: half the client's ``socket_timeout`` when it has one, so that a
      BLPOP never outlasts the socket timeout, else 1 s.
    * The queue and the wake keys expire on their own (the queue shortly after its last
      waiter's wait slice, a wake after a few seconds): nothing lingers after use.
    * ``watchdog=True`` (requires ``timeout``) renews the TTL every ``timeout / 3`` from
      a daemon thread while the lock is held. If a renewal finds the lock is not ours
      any more, or Redis fails, the watchdog stops, :attr:`lost` becomes True and
      ``on_lost(lock)`` is called once, from the watchdog thread. A holder whose lock
      is lost must not commit its work.
    * ``thread_local=True`` keeps the token (and the watchdog state) per thread, as in
      redis-py.
    * Redis failures (``ConnectionError``, ``TimeoutError``) propagate to the caller,
      except a client-side timeout of the ``SET`` or of the queueing script (resolved by
      reading the key), of the withdrawing script (run once more: it is idempotent) or of
      a ``BLPOP`` (waited again). A waiter whose ``acquire`` raised may still be queued
      until its entry goes stale; ``release()`` with its token withdraws it (and
      releases the lock if it was handed over meanwhile).
    * ``replicas=N`` (requires ``timeout``): an acquisition counts only once N replicas
      hold it. Right after taking the lock, one pipeline resets its TTL (a write of this
      connection, after the take) and sends ``WAIT N`` for up to ``replica_timeout``
      seconds. If fewer replicas acknowledge, ``acquire`` releases what it took (handing it
      on, as a release does) and returns False, without trying again: a lock only the
      primary holds is lost if the primary dies before replicating it, and a replica
      promoted then grants it a second time. (Redis replication is asynchronous: this
      narrows the window to a failover within ``replica_timeout`` of a lost replica, it
      does not make the lock a consensus.)
    * ``reentrant=True``: a thread that holds the lock (through any reentrant ``Lock`` of the
      same name on the same client) takes it again at once, a count going up, instead of
      waiting for itself; each ``release`` takes one off, and the lock is released when the
      count is back at 0. Taking it again checks, in one round trip, that the lock is still
      this thread's (and resets its TTL); if it is not (it expired), the acquisition starts
      afresh. Release in the reverse order of acquisition: the first acquisition's watchdog
      keeps the lock for all of them.
    * ``wake_hub="<prefix>"``: waiters wait through this process's wake hub
      (:mod:`locking.wakes`) instead of each blocking in ``BLPOP`` on a connection of its own:
      the release pushes the hand-over onto the hub's one list, ``<prefix>:<hub id>``, and
      the hub's one connection wakes the waiter in-process. A waiter then holds no
      connection while it waits, so a thousand waiters do not need a thousand connections,
      and a bounded pool always has one for the holder's release. FIFO order, wait slices
      and the give-up rules are the same.
    * On a Redis Cluster (a ``redis.cluster.RedisCluster`` client) the name must carry a hash
      tag (``lock:{item:1}``): the scripts build the next owner's wake key and the fence key
      from the name inside Lua, and the tag keeps them, the queue and the waiters in the
      lock's slot. ``wake_hub`` needs a single Redis (ValueError on a cluster).
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
        *,
        watchdog: bool = False,
        on_lost: Callable[[Lock], object] | None = None,
        max_wait_slice: Number | None = None,
        replicas: int = 0,
        replica_timeout: Number = 0.1,
        reentrant: bool = False,
        wake_hub: str | None = None,
    ) -> None:
        if watchdog and not timeout:
            raise ValueError("watchdog=True needs a timeout: there is no TTL to renew")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
        if replicas and not timeout:
            raise ValueError("replicas needs a timeout: the check rewrites the lock's TTL")
        if replicas and replica_timeout <= 0:
            raise ValueError("replica_timeout must be positive")
        if max_wait_slice is not None and max_wait_slice <= 0:
            raise ValueError("max_wait_slice must be positive")
        self.redis = redis
        self.name = name
        self.timeout = timeout
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.raise_on_release_error = raise_on_release_error
        self.watchdog = watchdog
        self.on_lost = on_lost
        self.replicas = replicas
        self.replica_timeout = replica_timeout
        self.reentrant = reentrant
        self.wake_hub = wake_hub
        if is_cluster(redis):
            if not has_hash_tag(name):
                raise ValueError(
                    f"lock name {name!r} has no hash tag: on a Redis Cluster its helper keys "
                    "(queue, waiters, wakes, fence) must share its slot, e.g. 'lock:{item:1}'"
                )
            if wake_hub is not None:
                raise ValueError(
                    "wake_hub needs a single Redis: the hub's one list cannot share the slot "
                    "of every lock a process waits for"
                )
        # Locks of one name on one client are the same lock to a thread taking it again.
        self._reentry_key = (id(getattr(redis, "connection_pool", redis)), name)
        self.max_wait_slice = (
            float(max_wait_slice) if max_wait_slice is not None else _default_slice(redis)
        )
        # The keys a release names beside the lock's own (`_release_call`).
        self.queue_name = f"{name}:queue"
        self.waiters_name = f"{name}:waiters"
        # Built from the encoded name, as the release script builds it from KEYS[1].
        self._wake_prefix = redis.get_encoder().encode(name) + b":wake:"
        self._fence_name = redis.get_encoder().encode(name) + b":fence"
        self.local: Any = _ThreadState() if self.thread_local else SimpleNamespace()
        self.local.token = None
        self.local.lease = None
        self.local.fence = None
        self._take_or_queue_script = script_for(redis, handover_scripts.TAKE_OR_QUEUE)
        self._cancel_script = script_for(redis, handover_scripts.CANCEL)
        self._release_script = script_for(redis, handover_scripts.HAND_OVER)
        self._extend_script = script_for(redis, lock_scripts.EXTEND)

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> Lock:
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

    # -- acquisition -----------------------------------------------------------------

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Take the lock; return True once it is ours, False if we gave up.

        Non-blocking: a single ``SET NX``. Blocking: take the lock if free, else queue
        and wait until a release hands it over (or the lock expires, then try again),
        until ``blocking_timeout`` seconds have passed. ``token`` (str or bytes) replaces
        the random uuid4 owner token. ``sleep`` is accepted for redis-py compatibility
        and has no effect. With ``replicas``, True also means that many replicas hold it.
        """
        del sleep  # waiting is driven by wakes, not by a poll interval
        if self.reentrant and self._take_again():
            return True
        if not self._acquire(token, blocking, blocking_timeout):
            return False
        if self.replicas and not self._replicated():
            try:
                self.release()
            except LockNotOwnedError:
                pass  # it expired meanwhile: nothing of ours to give up
            return False
        if self.reentrant:
            _reentries.held[self._reentry_key] = [self.local.token, 1, self.local.fence]
        return True

    def _take_again(self) -> bool:
        """Whether this thread holds the lock already (then it is taken once more)."""
        held = _reentries.held.get(self._reentry_key)
        if held is None:
            return False
        token = held[0]
        still_ours = (
            self._pexpire(token, self._ttl_ms() or 0, True)
            if self.timeout
            else self._is_token(self.redis.get(self.name), token)
        )
        if not still_ours:
            del _reentries.held[self._reentry_key]  # it expired: take it afresh
            return False
        held[1] += 1
        self.local.token = token
        self.local.fence = held[2]
        return True

    def _acquire(
        self,
        token: str | bytes | None,
        blocking: bool | None,
        blocking_timeout: Number | None,
    ) -> bool:
        if token is None:
            token_bytes = uuid.uuid4().hex.encode()
        else:
            token_bytes = self.redis.get_encoder().encode(token)
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout

        if not blocking:
            acquired, _, fence = self._take_or_queue(token_bytes, 0)
            if acquired:
                self._took(token_bytes, fence)
            return acquired

        hub = self._hub()
        if hub is None:
            return self._wait_in_turn(token_bytes, blocking_timeout, b"")
        hub.register(token_bytes)  # before queueing: no hand-over can come sooner
        try:
            return self._wait_in_turn(token_bytes, blocking_timeout, hub.key)
        finally:
            hub.unregister(token_bytes)

    def _hub(self) -> WakeHub | None:
        return None if self.wake_hub is None else hub_for(self.redis, self.wake_hub)

    def _wait_in_turn(
        self, token_bytes: bytes, blocking_timeout: Number | None, wake_list: bytes
    ) -> bool:
        """Take the lock, or queue for it and wait until handed it, taken for free, or out
        of time; a hand-over is pushed onto `wake_list` (b"": this waiter's own wake key)."""
        deadline = None if blocking_timeout is None else time.monotonic() + blocking_timeout
        # A queue entry is renewed after every wait slice; it stays valid a little longer.
        entry_ms = int(self.max_wait_slice * 1000) + QUEUE_GRACE_MS
        queued = False
        while True:
            valid_ms = entry_ms
            if deadline is not None:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    if queued:
                        return self._give_up(token_bytes) is not None
                    valid_ms = 0  # out of time already: one attempt, never queued
                else:
                    valid_ms = min(entry_ms, left_ms)
            acquired, pttl, fence = self._take_or_queue(token_bytes, valid_ms, wake_list)
            if acquired:
                self._took(token_bytes, fence)
                return True
            if valid_ms == 0:
                return False
            queued = True
            if pttl == -2:
                # The key vanished between our script and our read: try again at once.
                continue
            wait = self.max_wait_slice
            if pttl >= 0:
                # Never sleep past the holder's expiry: a dead holder's lock is free then.
                wait = min(wait, pttl / 1000)
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if wait < min(self.max_wait_slice, SERVER_TICK) and self.wake_hub is None:
                time.sleep(max(wait, MIN_WAIT))  # the hub's wait is an in-process event, on time
                continue
            fence = self._wait_for_handoff(token_bytes, wait)
            if fence is not None:
                # The release set the lock to our token before pushing our wake.
                self._took(token_bytes, fence)
                return True

    def _replicated(self) -> bool:
        """Whether `replicas` replicas hold the lock we just took: a write of ours after the
        take (the TTL set again, if the lock is still ours), then WAIT, on one connection."""
        pipe = self.redis.pipeline(transaction=False)
        self._extend_script(
            keys=[self.name], args=[self.local.token, self._ttl_ms() or 0, "1"], client=pipe
        )
        pipe.wait(self.replicas, max(1, int(self.replica_timeout * 1000)))
        ours, acknowledged = pipe.execute()
        return bool(ours) and int(acknowledged) >= self.replicas

    def adopt(self, token: str | bytes, fence: int | None = None) -> None:
        """Hold the lock as if ``acquire`` had just taken it with ``token``.

        For a caller whose own script took the lock (``SET name token NX PX`` with this
        lock's TTL, and the grant's fencing token, ``fence``) in the same step as something
        else, e.g. choosing which of several locks to take. The watchdog, ``release``,
        ``owned`` and ``fence`` then work as after ``acquire``.
        """
        self._took(self.redis.get_encoder().encode(token), fence)

    def _take_or_queue(
        self, token: bytes, valid_ms: int, wake_list: bytes = b""
    ) -> tuple[bool, int, int | None]:
        """Take the lock if free, else queue ``token`` for ``valid_ms`` (0: do not queue),
        to be woken on ``wake_list`` (b"": its own wake key).

        Returns (acquired, PTTL of the lock when not acquired, the fence when acquired).
        """
        try:
            acquired, pttl, *fence = self._take_or_queue_script(
                keys=[self.name, self.queue_name, self.waiters_name, self._wake_key(token)],
                args=[token, self._ttl_ms() or 0, valid_ms, wake_list],
                client=self.redis,
            )
            return bool(acquired), int(pttl), int(fence[0]) if acquired else None
        except RedisTimeoutError:
            # The client gave up waiting, but the script may have run (or may still run) on
            # the server: only the stored value tells whether the lock is ours. If it queued
            # us, the wait below or the withdrawal when we give up takes care of it.
            return self._read_back(token)

    def _read_back(self, token: bytes) -> tuple[bool, int, int | None]:
        # If this read fails the error propagates: Redis is unusable for now.
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.name)
        pipe.pttl(self.name)
        pipe.get(self._fence_name)
        stored, pttl, fence = pipe.execute()
        if self._is_token(stored, token):
            # A release may have pushed a wake for us meanwhile: nobody will read it. The
            # lock holds our token, so its latest grant, and fence, was ours.
            self.redis.delete(self._wake_key(token))
            return True, 0, int(fence or 0)
        return False, int(pttl), None

    def _give_up(self, token: bytes) -> int | None:
        """Withdraw from the queue; the fence if a release handed us the lock just before,
        else None."""
        keys: list[str | bytes] = [self.name, self.queue_name, self.waiters_name]
        keys.append(self._wake_key(token))
        try:
            kept, fence = self._cancel_script(keys=keys, args=[token], client=self.redis)
        except RedisTimeoutError:
            # The withdrawal may have run, or may still run. Running it again reads the
            # key and withdraws in one step, so its answer is final whichever of the two
            # runs first: after either one, no release can hand us the lock any more.
            # If this one fails too, the error propagates (see release()).
            kept, fence = self._cancel_script(keys=keys, args=[token], client=self.redis)
        if not kept:
            return None
        self._took(token, int(fence))
        return int(fence)

    def _wait_for_handoff(self, token: bytes, seconds: float) -> int | None:
        """Block on our wake key; once a release has handed us the lock, the fence it
        granted us (pushed onto the wake), else None."""
        # Milliseconds are Redis' resolution; rounding also keeps the float out of
        # exponent notation.
        seconds = round(max(seconds, MIN_WAIT), 3)
        hub = self._hub()
        if hub is not None:
            return hub.wait(token, seconds)
        try:
            woken = self.redis.blpop([self._wake_key(token)], timeout=seconds)
        except RedisTimeoutError:
            # Only the client's socket timeout fired; it means no wake came in time (a
            # wake popped by the lost reply is not lost: the next script finds the lock
            # holding our token, and its fence). The next script will surface a Redis that
            # is gone.
            return None
        return None if woken is None else int(woken[1])

    def _wake_key(self, token: bytes) -> bytes:
        return self._wake_prefix + token

    def _ttl_ms(self) -> int | None:
        if not self.timeout:
            return None
        return max(1, int(self.timeout * 1000))

    def _is_token(self, stored: Any, token: bytes | None) -> bool:
        if stored is None or token is None:
            return False
        if not isinstance(stored, bytes):
            stored = self.redis.get_encoder().encode(stored)
        return stored == token

    def _took(self, token: bytes, fence: int | None) -> None:
        self._stop_watchdog()
        lease = _Lease(token)
        self.local.token = token
        self.local.fence = fence
        self.local.lease = lease
        if self.watchdog:
            self._start_watchdog(lease)

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
        """True once the watchdog found the current acquisition gone or could not renew it.

        Stays True after release until the next acquire. Always False without a
        watchdog: nothing monitors the lock then, use :meth:`ensure_held`.
        """
        lease = self.local.lease
        return lease is not None and lease.lost

    def ensure_held(self) -> None:
        """Raise LockNotOwnedError unless the lock is still ours (checks ``lost``, then one GET).

        Call it right before committing work done under the lock.
        """
        if self.lost or not self.owned():
            raise LockNotOwnedError("The lock is no longer owned", lock_name=self.name)

    # -- release / TTL ---------------------------------------------------------------

    def release(self, *, after: tuple[str, list[Any], list[Any]] | None = None) -> None:
        """Release the lock: hand it to the first queued waiter, or delete it.

        ``after``: (a script's source, its keys, its arguments) to run first, in the same
        call to Redis (`scripts.chain`): one round trip where two would be, and the
        next holder finds its effect. It runs whether or not the lock is still ours. On a
        cluster its keys must share the lock's slot.

        Raises LockError if this lock was not acquired, LockNotOwnedError if it has
        been taken over or has expired meanwhile (then the lock is left alone; only a
        queue entry of this token, left by an acquire that failed midway, is withdrawn).
        """
        expected = self.local.token
        if expected is None:
            raise LockError(
                "Cannot release a lock that's not owned or is already unlocked.",
                lock_name=self.name,
            )
        self.local.token = None
        self.local.fence = None
        if self.reentrant:
            held = _reentries.held.get(self._reentry_key)
            if held is not None and held[0] == expected:
                held[1] -= 1
                if held[1] > 0:
                    if after is not None:  # still held: what was to go with the release goes alone
                        source, before_keys, before_args = after
                        script_for(self.redis, source)(
                            keys=before_keys, args=before_args, client=self.redis
                        )
                    return  # taken more than once: still held
                del _reentries.held[self._reentry_key]
        self._stop_watchdog()
        source, keys, args = _release_call(self.name, expected, after=after)
        script = self._release_script if after is None else script_for(self.redis, source)
        released = script(keys=keys, args=args, client=self.redis)
        if not released:
            raise LockNotOwnedError(
                "Cannot release a lock that's no longer owned", lock_name=self.name
            )

    def released_elsewhere(self) -> None:
        """Forget the current acquisition without a call to Redis: another process has
        released the lock with its token (`release_each_call`), e.g. the one that committed the
        work done under it. Stops the watchdog, as ``release`` does; a renewal that ran between
        that release and this call reports the lock lost.

        Raises LockError if this lock was not acquired, or is reentrant (a process other than
        the holder cannot know how many times it was taken).
        """
        if self.local.token is None or self.reentrant:
            raise LockError(
                "Only a lock held once, and not reentrant, can be released elsewhere",
                lock_name=self.name,
            )
        self.local.token = None
        self.local.fence = None
        self._stop_watchdog()

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

    def _pexpire(self, token: bytes, ms: int, replace_ttl: bool) -> bool:
        return bool(
            self._extend_script(
                keys=[self.name], args=[token, ms, "1" if replace_ttl else "0"], client=self.redis
            )
        )

    # -- watchdog --------------------------------------------------------------------

    def _start_watchdog(self, lease: _Lease) -> None:
        # The watchdog gets the token through the lease: the token is thread-local
        # and would be invisible from the watchdog's thread. It holds the lock only
        # weakly so that an abandoned lock object lets its lease expire.
        ttl_ms = self._ttl_ms()
        assert self.timeout and ttl_ms, "watchdog=True needs a timeout (checked in __init__)"
        interval = self.timeout / 3
        _scheduler.schedule(
            time.monotonic() + interval,
            lease,
            _WatchdogStart(weakref.ref(self), self.name, interval, ttl_ms),
        )

    def _stop_watchdog(self) -> None:
        lease = self.local.lease
        if lease is None or not self.watchdog:
            return
        with lease.state_lock:
            lease.stop.set()
        thread = lease.thread
        if thread is not None and thread is not threading.current_thread():
            # At most one renewal is in flight; the watchdog cannot act after the stop
            # flag is set (see _watch), so a slow join is only a delay, not a risk.
            thread.join(timeout=1.0)


def _release_call(name: str, token: str | bytes, *, after: ScriptCall | None = None) -> ScriptCall:
    """What ``Lock.release`` sends for the lock ``name`` held with ``token`` (and ``after``, run
    first in the same call), as (script source, keys, arguments)."""
    keys: list[Any] = [name, f"{name}:queue", f"{name}:waiters"]
    args: list[Any] = [token, WAKE_TTL_MS]
    if after is None:
        return handover_scripts.HAND_OVER, keys, args
    return chain(after, (handover_scripts.HAND_OVER, keys, args))


def release_each_call(
    prelude: str, releases: Sequence[tuple[str, str | bytes, list[Any], list[Any]]]
) -> tuple[str, list[Any], list[Any]]:
    """One script call that releases several locks other processes took, each as
    ``Lock.release(after=(prelude, keys, args))`` would, hand-over included: ``releases`` holds,
    for each lock, its name, the token it is held with and ``prelude``'s keys and arguments for
    it. Returned as (script source, keys, arguments) (`release_each`). The holders then
    call ``Lock.released_elsewhere``. Its answer is a list of the releases' answers
    (`HAND_OVER`): 2 when a lock went to its first waiter, 1 when it was deleted, 0 when
    its token no longer held it (then only a queue entry of the token is withdrawn). Not for a
    Redis Cluster: the keys of one call must share a slot there."""
    keys: list[Any] = []
    args: list[Any] = [len(releases)]
    for name, token, prelude_keys, prelude_args in releases:
        _, release_keys, release_args = _release_call(name, token)
        keys += [*prelude_keys, *release_keys]
        args += [len(prelude_keys), len(prelude_args), *prelude_args, *release_args]
    return handover_scripts.release_each(prelude), keys, args


class _WatchdogStart:
    """What the scheduler needs to start a lease's watchdog thread once it is due."""

    __slots__ = ("lock_ref", "name", "interval", "ttl_ms")

    def __init__(
        self, lock_ref: weakref.ref[Lock], name: str, interval: float, ttl_ms: int
    ) -> None:
        self.lock_ref = lock_ref
        self.name = name
        self.interval = interval
        self.ttl_ms = ttl_ms

    def __call__(self, lease: _Lease, due: float) -> None:
        if self.lock_ref() is None:
            return  # abandoned: let the lease expire
        with lease.state_lock:
            if lease.stop.is_set():
                return  # released meanwhile
            lease.thread = threading.Thread(
                target=_watch,
                args=(self.lock_ref, lease, self.interval, self.ttl_ms, due),
                name=f"lock-watchdog:{self.name}",
                daemon=True,
            )
            lease.thread.start()


class _WatchdogScheduler:
    """One daemon thread per process that starts a lease's watchdog when its first
    renewal is due, unless the lease was released before.

    Scheduling costs a heap push under a lock; released leases are not removed, they are
    dropped when they come due. A wake-up is only needed when the new lease comes due
    before every pending one, which is rare under load (the pending ones are older).

    Each wake-up takes every lease coming due within `COALESCE` seconds, not only those due
    now: a process selling hundreds of units a second would otherwise wake this thread once
    per sale, each wake a context switch and a turn at the interpreter lock taken from the
    thread serving the sales. A watchdog started early waits for its lease's due time.
    """

    #: Seconds ahead whose due leases one wake-up takes: at most 1 / COALESCE wake-ups a second.
    COALESCE = 0.1

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._pending: list[tuple[float, int, _Lease, _WatchdogStart]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, due: float, lease: _Lease, start: _WatchdogStart) -> None:
        with self._condition:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lock-watchdog-scheduler", daemon=True
                )
                self._thread.start()
            wake = not self._pending or due < self._pending[0][0]
            heapq.heappush(self._pending, (due, next(self._order), lease, start))
            if wake:
                self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while True:
                    now = time.monotonic()
                    if self._pending and self._pending[0][0] <= now:
                        break
                    self._condition.wait(self._pending[0][0] - now if self._pending else None)
                due = []
                horizon = now + self.COALESCE
                while self._pending and self._pending[0][0] <= horizon:
                    due.append(heapq.heappop(self._pending))
            for when, _, lease, start in due:
                if lease.stop.is_set():
                    continue
                try:
                    start(lease, when)
                except Exception:  # keep serving the other leases
                    logger.exception("could not start the watchdog of lock %r", start.name)


_scheduler = _WatchdogScheduler()


def _new_scheduler_after_fork() -> None:
    # The scheduler's thread does not survive a fork, and its lock may have been held by
    # it at the time: the child starts afresh (it holds none of the parent's leases).
    global _scheduler
    _scheduler = _WatchdogScheduler()


os.register_at_fork(after_in_child=_new_scheduler_after_fork)


def _watch(
    lock_ref: weakref.ref[Lock], lease: _Lease, interval: float, ttl_ms: int, first_at: float
) -> None:
    """Watchdog loop: renew the TTL at ``first_at`` and then every ``interval`` until
    stopped, or report the loss."""
    # Scheduled from the previous renewal's start, so a slow round trip does not
    # stretch the period and eat into the TTL margin.
    next_at = first_at
    while not lease.stop.wait(max(0.0, next_at - time.monotonic())):
        next_at = max(next_at + interval, time.monotonic())
        if not _renew(lock_ref, lease, ttl_ms):
            return


def _renew(lock_ref: weakref.ref[Lock], lease: _Lease, ttl_ms: int) -> bool:
    """One renewal; False when the watchdog must stop.

    A separate function so the strong reference to the lock dies with this frame and
    is not held while the watchdog sleeps.
    """
    lock = lock_ref()
    if lock is None:
        return False
    try:
        if lock._pexpire(lease.token, ttl_ms, True):
            _tell_listeners(lock, renewed=True)
            return True
    except RedisError:
        logger.warning("Watchdog could not renew lock %r", lock.name, exc_info=True)
    with lease.state_lock:
        if lease.stop.is_set():
            return False  # released meanwhile: the failure comes from our own release
        lease.lost = True
        lease.stop.set()
    logger.warning("Lock %r was lost while held", lock.name)
    _tell_listeners(lock, renewed=False)
    if lock.thread_local:
        # This thread serves this acquisition only: let code in on_lost see it through
        # the thread-local attributes (lost, owned()).
        lock.local.lease = lease
        lock.local.token = lease.token
    if lock.on_lost is not None:
        try:
            lock.on_lost(lock)
        except Exception:
            logger.exception("on_lost callback of lock %r failed", lock.name)
    return False


def _tell_listeners(lock: Lock, *, renewed: bool) -> None:
    for listener in watchdog_listeners:
        try:
            listener(lock, renewed)
        except Exception:
            logger.exception("watchdog listener %r failed", listener)


def _default_slice(client: Any) -> float:
    # A Redis keeps its connections' options on its pool, a RedisCluster on its nodes manager.
    pool = getattr(client, "connection_pool", None) or getattr(client, "nodes_manager", None)
    kwargs = getattr(pool, "connection_kwargs", None) or {}
    socket_timeout = kwargs.get("socket_timeout")
    if socket_timeout:
        return float(socket_timeout) / 2
    return DEFAULT_MAX_WAIT_SLICE
