"""The lock's replica check: an acquisition counts only once ``replicas`` replicas hold it,
so that a failover right after the grant does not hand the lock out a second time.

Redis replication is asynchronous: this narrows the window to a failover within
``replica_timeout`` of a lost replica, it does not make the lock a consensus (`QuorumLock`
holds one over independent masters). See docs/design.md#locks.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import LockNotOwnedError

from .core import LockCore, Number


class Replicated(LockCore):
    """The core lock, granted only once ``replicas`` replicas acknowledge it.

    Contract, beside :class:`LockCore`'s: with ``replicas=N`` (N >= 1; requires ``timeout``),
    right after taking the lock one pipeline resets its TTL (a write of this connection, after
    the take) and sends ``WAIT N`` for up to ``replica_timeout`` seconds. If fewer replicas
    acknowledge, ``acquire`` releases what it took (handing it on, as a release does) and
    returns False, without trying again: a lock only the primary holds is lost if the primary
    dies before replicating it, and a replica promoted then grants it a second time.
    """

    def __init__(
        self, *args: Any, replicas: int, replica_timeout: Number = 0.1, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if not self.timeout:
            raise ValueError("replicas needs a timeout: the check rewrites the lock's TTL")
        if replica_timeout <= 0:
            raise ValueError("replica_timeout must be positive")
        self.replicas = replicas
        self.replica_timeout = replica_timeout

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        if not super().acquire(sleep, blocking, blocking_timeout, token):
            return False
        if not self._replicated():
            try:
                self.release()
            except LockNotOwnedError:
                pass  # it expired meanwhile: nothing of ours to give up
            return False
        return True

    def _replicated(self) -> bool:
        """Whether `replicas` replicas hold the lock we just took: a write of ours after the
        take (the TTL set again, if the lock is still ours), then WAIT, on one connection."""
        pipe = self.redis.pipeline(transaction=False)
        self._pexpire(self.local.token, self._ttl_ms() or 0, True, client=pipe)
        pipe.wait(self.replicas, max(1, int(self.replica_timeout * 1000)))
        ours, acknowledged = pipe.execute()
        return bool(ours) and int(acknowledged) >= self.replicas
