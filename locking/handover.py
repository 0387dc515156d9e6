"""The lock's FIFO hand-over: waiters queue in Redis and a release hands the lock straight to
the longest waiter, instead of waiters polling (`LockCore`'s ``sleep``).

A blocking ``acquire`` runs one script that takes the lock if it is free or else queues the
caller's token, then blocks in ``BLPOP`` on a wake key of its own (`locking.wakes`: on its
process's wake hub). The release script sets the lock to the first waiter's token, with that
waiter's TTL, and pushes its wake: the woken waiter owns the lock without another round trip,
and no newcomer can take it in between. Each wait is capped by the lock's remaining TTL, so a
lock whose holder died is taken as soon as it expires. Scripts: `scripts.handover`.
See docs/design.md#locks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

from redis.exceptions import TimeoutError as RedisTimeoutError

from .core import LockCore, Number
from .scripts import ScriptCall, script_for
from .scripts import handover as handover_scripts

#: Lifetime of a wake nobody consumed; long enough for a waiter that is between its
#: queueing script and its BLPOP to still find it, short enough that nothing lingers.
WAKE_TTL_MS = 3000

#: How long a queue entry outlives the wait slice its waiter is blocked for. A live waiter
#: renews its entry after every slice, so this only needs to cover one round trip and some
#: scheduling delay; past it, a release skips the entry (its waiter is dead, or so late that
#: it will queue again, at the tail). It bounds how long after a waiter died a release can
#: still hand the dead waiter the lock.
QUEUE_GRACE_MS = 1000

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


class FifoHandOver(LockCore):
    """The core lock whose waiters queue, and whose release hands the lock to the first.

    Contract, beside :class:`LockCore`'s:

    * A blocking ``acquire`` that finds the lock taken queues its token in ``<name>:queue``
      (FIFO; details in ``<name>:waiters``) and waits on ``<name>:wake:<token>``. ``release``
      hands the lock to the first queued waiter that is still waiting (it sets the lock to that
      waiter's token, with that waiter's ``timeout``), or deletes it when none is. Waiters
      therefore get the lock in the order they queued. A newcomer only takes the lock when it
      is free, which with waiters queued happens only after the lock expired: the queued
      waiters wake by then and compete for it too, so nobody starves.
    * A waiter that gives up (``blocking_timeout``) withdraws from the queue in one script; if
      a release handed it the lock just before, it keeps the lock and ``acquire`` returns True.
      A lock is never left to a waiter whose ``acquire`` returned False.
    * A waiter that dies while queued may still be handed the lock, for up to
      ``max_wait_slice`` + 1 s after its death (its queue entry is renewed by the living waiter
      after every wait slice, and skipped once it is that stale). That lock then expires after
      the dead waiter's ``timeout``, exactly like the lock of a holder that crashed; without a
      ``timeout`` it never does.
    * Tokens must be unique per acquisition (the default uuid4 tokens are): a queued token is
      how a release finds its waiter.
    * ``sleep`` is accepted for compatibility only: waiting is driven by wakes, so no poll
      interval delays an acquisition. A non-blocking ``acquire`` runs a single script and never
      queues.
    * ``max_wait_slice`` (an attribute) bounds a single BLPOP, which bounds the delay when a
      wake is missed: half the client's ``socket_timeout`` when it has one, so that a BLPOP
      never outlasts the socket timeout, else 1 s. A test may set it before ``acquire``.
    * The queue and the wake keys expire on their own (the queue shortly after its last
      waiter's wait slice, a wake after a few seconds): nothing lingers after use.
    * A client-side timeout of the queueing script is resolved by reading the key, of the
      withdrawing script by running it once more (it is idempotent), of a ``BLPOP`` by waiting
      again. A waiter whose ``acquire`` raised may still be queued until its entry goes stale;
      ``release()`` with its token withdraws it (and releases the lock if it was handed over
      meanwhile). A release of a lock no longer ours withdraws only a queue entry of its token.
    """

    #: Whether a wait shorter than the server's tick is slept on the client (`SERVER_TICK`);
    #: a variant whose wait is an in-process event (`locking.wakes`) is woken on time.
    sleeps_short_waits: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_wait_slice = _default_slice(self.redis)
        # The keys a release names beside the lock's own (`release_call`).
        self.queue_name = f"{self.name}:queue"
        self.waiters_name = f"{self.name}:waiters"
        # Built from the encoded name, as the release script builds it from KEYS[1].
        self._wake_prefix = self.redis.get_encoder().encode(self.name) + b":wake:"

    # -- acquisition -----------------------------------------------------------------

    def _grant(
        self, token: bytes, blocking: bool, blocking_timeout: Number | None, sleep: Number
    ) -> int | None:
        """Take the lock if free, else queue and wait until a release hands it over (or the
        lock expires, then try again), until ``blocking_timeout`` seconds have passed."""
        if not blocking:
            return super()._grant(token, blocking, blocking_timeout, sleep)  # one take
        return self._wait_in_turn(token, blocking_timeout, b"")

    def _wait_in_turn(
        self, token: bytes, blocking_timeout: Number | None, wake_list: bytes
    ) -> int | None:
        """Take the lock, or queue for it and wait until handed it, taken for free, or out
        of time; a hand-over is pushed onto `wake_list` (b"": this waiter's own wake key).
        The fence of the grant, or None."""
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
                        return self._give_up(token)
                    valid_ms = 0  # out of time already: one attempt, never queued
                else:
                    valid_ms = min(entry_ms, left_ms)
            acquired, pttl, fence = self._take_or_queue(token, valid_ms, wake_list)
            if acquired:
                return fence
            if valid_ms == 0:
                return None
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
            if wait < min(self.max_wait_slice, SERVER_TICK) and self.sleeps_short_waits:
                time.sleep(max(wait, MIN_WAIT))
                continue
            fence = self._wait_for_handoff(token, wait)
            if fence is not None:
                return fence  # the release set the lock to our token before pushing our wake

    def _take(self, token: bytes) -> tuple[bool, int, int | None]:
        return self._take_or_queue(token, 0)  # also drops a queue entry the token left

    def _take_or_queue(
        self, token: bytes, valid_ms: int, wake_list: bytes = b""
    ) -> tuple[bool, int, int | None]:
        """Take the lock if free, else queue ``token`` for ``valid_ms`` (0: do not queue),
        to be woken on ``wake_list`` (b"": its own wake key).

        Returns (acquired, PTTL of the lock when not acquired, the fence when acquired).
        """
        try:
            acquired, pttl, *fence = script_for(self.redis, handover_scripts.TAKE_OR_QUEUE)(
                keys=[self.name, self.queue_name, self.waiters_name, self._wake_key(token)],
                args=[token, self._ttl_ms() or 0, valid_ms, wake_list],
                client=self.redis,
            )
            return bool(acquired), int(pttl), int(fence[0]) if acquired else None
        except RedisTimeoutError:
            # As in `LockCore._take`. If it queued us, the wait or the withdrawal when we give
            # up takes care of it.
            return self._read_back(token)

    def _read_back(self, token: bytes) -> tuple[bool, int, int | None]:
        taken = super()._read_back(token)
        if taken[0]:
            # A release may have pushed a wake for us meanwhile: nobody will read it.
            self.redis.delete(self._wake_key(token))
        return taken

    def _give_up(self, token: bytes) -> int | None:
        """Withdraw from the queue; the fence if a release handed us the lock just before,
        else None."""
        keys: list[str | bytes] = [self.name, self.queue_name, self.waiters_name]
        keys.append(self._wake_key(token))
        cancel = script_for(self.redis, handover_scripts.CANCEL)
        try:
            kept, fence = cancel(keys=keys, args=[token], client=self.redis)
        except RedisTimeoutError:
            # The withdrawal may have run, or may still run. Running it again reads the
            # key and withdraws in one step, so its answer is final whichever of the two
            # runs first: after either one, no release can hand us the lock any more.
            # If this one fails too, the error propagates (see release()).
            kept, fence = cancel(keys=keys, args=[token], client=self.redis)
        return int(fence) if kept else None

    def _wait_for_handoff(self, token: bytes, seconds: float) -> int | None:
        """Block on our wake key; once a release has handed us the lock, the fence it
        granted us (pushed onto the wake), else None."""
        # Milliseconds are Redis' resolution; rounding also keeps the float out of
        # exponent notation.
        seconds = round(max(seconds, MIN_WAIT), 3)
        try:
            woken = self.redis.blpop([self._wake_key(token)], timeout=seconds)
        except RedisTimeoutError:
            # Only the client's socket timeout fired; it means no wake came in time (a
            # wake popped by the lost reply is not lost: the next script finds the lock
            # holding our token, and its fence). The next script will surface a Redis that
            # is gone.
            return None
        if woken is None:
            return None
        _wake_key, fence = woken  # the release pushed the fence it granted us
        return int(fence)

    def _wake_key(self, token: bytes) -> bytes:
        return self._wake_prefix + token

    # -- release ---------------------------------------------------------------------

    def _release_call(self, token: bytes) -> ScriptCall:
        return release_call(self.name, token)


def release_call(name: str, token: str | bytes) -> ScriptCall:
    """The script call that releases the lock ``name`` held with ``token``, handing it to its
    first waiter (`scripts.handover.HAND_OVER`)."""
    keys: list[Any] = [name, f"{name}:queue", f"{name}:waiters"]
    return handover_scripts.HAND_OVER, keys, [token, WAKE_TTL_MS]


def release_each_call(
    prelude: str, releases: Sequence[tuple[str, str | bytes, list[Any], list[Any]]]
) -> ScriptCall:
    """One script call that releases several locks other processes took, each as
    ``Lock.release(after=(prelude, keys, args))`` would, hand-over included: ``releases`` holds,
    for each lock, its name, the token it is held with and ``prelude``'s keys and arguments for
    it (`scripts.handover.release_each`). The holders then call ``Lock.released_elsewhere``. Its
    answer is a list of the releases' answers (`HAND_OVER`): 2 when a lock went to its first
    waiter, 1 when it was deleted, 0 when its token no longer held it (then only a queue entry
    of the token is withdrawn). Not for a Redis Cluster: the keys of one call must share a slot
    there."""
    keys: list[Any] = []
    args: list[Any] = [len(releases)]
    for name, token, prelude_keys, prelude_args in releases:
        _, release_keys, release_args = release_call(name, token)
        keys += [*prelude_keys, *release_keys]
        args += [len(prelude_keys), len(prelude_args), *prelude_args, *release_args]
    return handover_scripts.release_each(prelude), keys, args


def _default_slice(client: Any) -> float:
    # A Redis keeps its connections' options on its pool, a RedisCluster on its nodes manager.
    pool = getattr(client, "connection_pool", None) or getattr(client, "nodes_manager", None)
    kwargs = getattr(pool, "connection_kwargs", None) or {}
    socket_timeout = kwargs.get("socket_timeout")
    if socket_timeout:
        return float(socket_timeout) / 2
    return DEFAULT_MAX_WAIT_SLICE
