"""A lock held on a majority of independent Redis masters (the RedLock algorithm), with a
fencing token from one outside source."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, Literal

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import LockError, LockNotOwnedError, RedisError

from .core import ContextManaged
from .scripts import lock as lock_scripts
from .scripts import script_for

logger = logging.getLogger(__name__)

Number = int | float

# KEYS[1] lock name; ARGV[1] token, ARGV[2] TTL in ms. Resets the TTL if the lock holds the
# token: 1, else 0.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class _State(threading.local):
    token: bytes | None = None
    fence: int | None = None
    lost: bool = False
    stop: threading.Event | None = None


class ProcessFences:
    """A ``fence_source`` that counts up in this process's memory, one count for every lock
    name: monotonic for as long as the process lives, and for nothing beyond it. For one
    process's own locks (a test, a demonstration); a shop of several processes or hosts needs
    a source they share (`inventory.fences` uses the database)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self, name: str) -> int:
        with self._lock:
            return next(self._next)


class QuorumLock(ContextManaged):
    """A lock held on a majority of N independent Redis masters; API of :class:`locking.Lock`.

    Contract:

    * ``acquire`` sets ``name`` to one token with ``SET NX PX`` on every master, one after
      another. It holds the lock when a majority (N // 2 + 1) said yes and time is left of the
      TTL once the round is over: validity = TTL - the round's duration - (TTL * drift_factor
      + 2 ms). Otherwise it deletes what it set (compare-and-delete on every master) and, when
      blocking, tries again after a random pause of up to ``retry_delay`` seconds, until
      ``blocking_timeout``. There is no queue across masters: waiters retry with jitter, so
      the FIFO hand-over of :class:`locking.Lock` does not exist here.
    * A master that errors or times out counts as a no. When fewer than a majority of masters
      answer at all, ``acquire`` raises :class:`redis.exceptions.ConnectionError` (the
      lock service is down, not busy), having deleted what it set on the others.
    * ``fence``: with ``fence_source``, once the quorum is won the lock calls
      ``fence_source(name)`` and holds its answer as the fencing token of this acquisition.
      It must come from one monotonic source outside the masters (a database sequence, say):
      a master that restarted empty would hand out numbers it handed out before. If the
      source raises, the lock is deleted everywhere and the error propagates. Without a
      source ``fence`` is None, and writes made under the lock cannot be fenced.
    * ``release`` deletes the lock on every master where it holds our token; masters that
      error keep it until its TTL. It raises :class:`LockNotOwnedError` when no master held
      our token and none errored (the lock expired), :class:`LockError` when not acquired.
    * ``watchdog=True`` renews the TTL on every master every ``timeout / 3`` from a daemon
      thread. When fewer than a majority renew, :attr:`lost` becomes True, ``on_lost(lock)``
      is called once and renewal stops. A holder whose lock is lost must not commit.
    * ``owned()`` is True while a majority of masters hold our token.
    * Clients should be built with short socket timeouts and no retries (a retried ``SET``
      may have run), as the shop builds them.
    * Known limits (of every lock of this kind): a holder paused past the validity, or a
      master whose clock jumps forward, or one that restarts empty while holding the lock,
      can let two holders overlap. The fencing token, checked by the store the lock guards,
      is what makes that harmless.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        name: str,
        timeout: Number | None = None,
        sleep: Number = 0.1,
        blocking: bool = True,
        blocking_timeout: Number | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        *,
        watchdog: bool = False,
        on_lost: Callable[[QuorumLock], object] | None = None,
        fence_source: Callable[[str], int] | None = None,
        drift_factor: float = 0.01,
        retry_delay: float = 0.05,
    ) -> None:
        if not clients:
            raise ValueError("a quorum lock needs at least one master")
        if timeout is None or timeout <= 0:
            raise ValueError("a quorum lock needs a positive timeout: its validity is bounded")
        if not 0 <= drift_factor < 1:
            raise ValueError("drift_factor must be from 0 to 1")
        if retry_delay < 0:
            raise ValueError("retry_delay must not be negative")
        self.clients = list(clients)
        self.quorum = len(self.clients) // 2 + 1
        self.name = name
        self.timeout = timeout
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.raise_on_release_error = raise_on_release_error
        self.watchdog = watchdog
        self.on_lost = on_lost
        self.fence_source = fence_source
        self.drift_factor = drift_factor
        self.retry_delay = retry_delay
        self.local: Any = (
            _State()
            if thread_local
            else SimpleNamespace(token=None, fence=None, lost=False, stop=None)
        )
        self._release = [script_for(client, lock_scripts.RELEASE) for client in self.clients]
        self._renew = [script_for(client, _RENEW) for client in self.clients]

    # -- acquisition -----------------------------------------------------------------

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(float(self.timeout or 0) * 1000))

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Take the lock on a majority of the masters; True once ours, False if we gave up."""
        del sleep  # retries pause for a random part of retry_delay
        blocking = self.blocking if blocking is None else blocking
        blocking_timeout = self.blocking_timeout if blocking_timeout is None else blocking_timeout
        raw = uuid.uuid4().hex if token is None else token
        owner = raw.encode() if isinstance(raw, str) else raw
        deadline = None if blocking_timeout is None else time.monotonic() + blocking_timeout
        while True:
            held, answered = self._take(owner)
            if held:
                self._hold(owner)
                return True
            if answered < self.quorum:
                raise RedisConnectionError(
                    f"quorum lock {self.name!r}: {answered} of {len(self.clients)} masters "
                    f"answered, a quorum is {self.quorum}"
                )
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return False
            pause = random.uniform(0, self.retry_delay)
            if deadline is not None:
                pause = min(pause, max(deadline - time.monotonic(), 0))
            time.sleep(pause)

    def _take(self, token: bytes) -> tuple[bool, int]:
        """One round of SET NX PX on every master: (held with time left, masters answering)."""
        ttl = self._ttl_ms
        started = time.monotonic()
        granted = answered = 0
        for client in self.clients:
            try:
                if client.set(self.name, token, nx=True, px=ttl):
                    granted += 1
                answered += 1
            except RedisError:
                continue
        elapsed_ms = (time.monotonic() - started) * 1000
        validity = ttl - elapsed_ms - (ttl * self.drift_factor + 2)
        if granted >= self.quorum and validity > 0:
            return True, answered
        self._delete_everywhere(token)
        return False, answered

    def _hold(self, token: bytes) -> None:
        fence = None
        if self.fence_source is not None:
            try:
                fence = int(self.fence_source(self.name))
            except BaseException:
                self._delete_everywhere(token)
                raise
        self.local.token = token
        self.local.fence = fence
        self.local.lost = False
        if self.watchdog:
            stop = threading.Event()
            self.local.stop = stop
            threading.Thread(
                target=self._watch,
                args=(token, stop),
                name=f"quorum-watchdog:{self.name}",
                daemon=True,
            ).start()

    def _delete_everywhere(self, token: bytes) -> tuple[int, int]:
        """Compare-and-delete on every master: (deleted, errors)."""
        deleted = errors = 0
        for release, client in zip(self._release, self.clients, strict=True):
            try:
                deleted += int(release(keys=[self.name], args=[token], client=client))
            except RedisError:
                errors += 1
        return deleted, errors

    def _renew_everywhere(self, token: bytes, ttl_ms: int) -> int:
        renewed = 0
        for renew, client in zip(self._renew, self.clients, strict=True):
            try:
                renewed += int(renew(keys=[self.name], args=[token, ttl_ms], client=client))
            except RedisError:
                continue
        return renewed

    def _watch(self, token: bytes, stop: threading.Event) -> None:
        interval = float(self.timeout or 0) / 3
        while not stop.wait(interval):
            if self._renew_everywhere(token, self._ttl_ms) >= self.quorum:
                continue
            if stop.is_set():
                return
            self._lose(token)
            return

    def _lose(self, token: bytes) -> None:
        # The watchdog's thread has its own thread-local state: mark the holder's.
        if self.local.token == token or isinstance(self.local, SimpleNamespace):
            self.local.lost = True
        self._lost_tokens.add(token)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost of quorum lock %r failed", self.name)

    @property
    def _lost_tokens(self) -> set[bytes]:
        lost = self.__dict__.get("_lost")
        if lost is None:
            lost = self.__dict__.setdefault("_lost", set())
        return lost

    # -- state -----------------------------------------------------------------------

    @property
    def fence(self) -> int | None:
        return self.local.fence if self.local.token is not None else None

    @property
    def lost(self) -> bool:
        token = self.local.token
        return bool(self.local.lost) or (token is not None and token in self._lost_tokens)

    def _holding(self, token: bytes | None) -> int:
        if token is None:
            return 0
        holding = 0
        for client in self.clients:
            try:
                if client.get(self.name) == token:
                    holding += 1
            except RedisError:
                continue
        return holding

    def owned(self) -> bool:
        """Whether a majority of the masters hold our token now."""
        return self._holding(self.local.token) >= self.quorum

    def locked(self) -> bool:
        """Whether a majority of the masters hold the lock for anyone."""
        holding = 0
        for client in self.clients:
            try:
                holding += int(client.exists(self.name))
            except RedisError:
                continue
        return holding >= self.quorum

    def ensure_held(self) -> None:
        if not self.owned():
            raise LockNotOwnedError(
                f"Cannot commit under quorum lock {self.name!r}: it is no longer ours",
                lock_name=self.name,
            )

    # -- release and renewal ---------------------------------------------------------

    def release(self) -> None:
        token = self.local.token
        if token is None:
            raise LockError("Cannot release an unlocked lock", lock_name=self.name)
        stop = self.local.stop
        if stop is not None:
            stop.set()
        self.local.token = None
        self.local.fence = None
        self.local.stop = None
        self._lost_tokens.discard(token)
        deleted, errors = self._delete_everywhere(token)
        if deleted == 0 and errors == 0:
            raise LockNotOwnedError(
                f"Cannot release quorum lock {self.name!r}: it was no longer ours",
                lock_name=self.name,
            )

    def extend(self, additional_time: Number, replace_ttl: bool = False) -> Literal[True]:
        """Reset the TTL to ``additional_time`` seconds on every master holding our token (the
        remaining TTL is not added to: each master's clock is its own)."""
        del replace_ttl
        token = self.local.token
        if token is None:
            raise LockError("Cannot extend an unlocked lock", lock_name=self.name)
        if self._renew_everywhere(token, max(1, int(additional_time * 1000))) < self.quorum:
            raise LockNotOwnedError(
                f"Cannot extend quorum lock {self.name!r}: a majority no longer holds it",
                lock_name=self.name,
            )
        return True

    def reacquire(self) -> Literal[True]:
        return self.extend(float(self.timeout or 0), replace_ttl=True)
