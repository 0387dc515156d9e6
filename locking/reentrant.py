"""The lock's reentrant mode: a thread that holds a lock takes it again at once, a count going
up, instead of waiting for itself; the lock is released when the count is back at 0.

Invariant: the count lives in this thread's memory, keyed by the client's pool and the lock's
name, so every reentrant lock object of one name on one client is the same lock to a thread.
See docs/design.md#locks.
"""

from __future__ import annotations

import threading
from typing import Any

from redis.exceptions import LockError

from .core import LockCore, Number
from .scripts import ScriptCall, script_for


class _Reentries(threading.local):
    """This thread's reentrant holds: (client's pool, lock name) -> [token, times taken, fence]."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], list[Any]] = {}


_reentries = _Reentries()


class Reentrant(LockCore):
    """The core lock, taken again by the thread holding it.

    Contract, beside :class:`LockCore`'s:

    * A thread that holds the lock (through any reentrant lock object of the same name on the
      same client) takes it again at once instead of waiting for itself; each ``release`` takes
      one off, and the lock is released when the count is back at 0.
    * Taking it again checks, in one round trip, that the lock is still this thread's (and
      resets its TTL); if it is not (it expired), the acquisition starts afresh.
    * A reentrant acquisition keeps the first one's token and fence. Release in the reverse
      order of acquisition: the first acquisition's watchdog keeps the lock for all of them.
    * A release that leaves the lock held still runs its ``after`` script, alone.
    * ``released_elsewhere`` raises LockError: a process other than the holder cannot know how
      many times it was taken.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Locks of one name on one client are the same lock to a thread taking it again.
        self._reentry_key = (id(getattr(self.redis, "connection_pool", self.redis)), self.name)

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        if self._take_again():
            return True
        if not super().acquire(sleep, blocking, blocking_timeout, token):
            return False
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

    def release(self, *, after: ScriptCall | None = None) -> None:
        if self._held_still(after):
            return
        super().release(after=after)

    def _held_still(self, after: ScriptCall | None) -> bool:
        """Take one off this thread's count; True if the lock stays held (taken more than
        once), and then ``after`` has run on its own."""
        held = _reentries.held.get(self._reentry_key)
        if held is None or self.local.token is None or held[0] != self.local.token:
            return False
        held[1] -= 1
        if held[1] == 0:
            del _reentries.held[self._reentry_key]
            return False
        self.local.token = None
        self.local.fence = None
        if after is not None:
            source, keys, args = after
            script_for(self.redis, source)(keys=keys, args=args, client=self.redis)
        return True

    def released_elsewhere(self) -> None:
        raise LockError(
            "Only a lock held once, and not reentrant, can be released elsewhere",
            lock_name=self.name,
        )
