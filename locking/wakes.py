"""One wake-up channel for all the lock waiters of a process, and `HubWoken`, the hand-over
whose waiters wait through it (`locking.WakeHubLock`).

A waiter with no hub blocks in ``BLPOP`` on a wake key of its own, holding a connection for
its whole wait: a thousand waiters hold a thousand connections, and with a bounded pool the
holder may find none left to release or renew its lock. A :class:`WakeHub` gives every waiter
of the process (of any lock on the same Redis) one list, ``<prefix>:<hub id>``, and one
connection of its own that blocks on it, so the connections a process opens do not grow with
its waiters.

Invariants: nothing is lost if the hub misses a wake (the release set the lock to the waiter's
token before pushing, and the waiter's next script finds it granted); the hub's list expires a
few seconds after its last wake, so a process that dies leaves nothing behind; a forked child
gets hubs of its own (`hub_for`). See docs/design.md#locks.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from typing import Any, NamedTuple

import redis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .cluster import is_cluster
from .core import Number
from .handover import MIN_WAIT, FifoHandOver

logger = logging.getLogger(__name__)

#: Longest single BLPOP of the hub (bounded by half the socket timeout, when there is one).
DEFAULT_SLICE = 1.0
#: How long the hub waits before it tries again after a Redis error, at most.
MAX_BACKOFF = 1.0


class HandOver(NamedTuple):
    """A wake on a hub's list: the lock went to the waiter holding ``token``, granted with
    ``fence``. Pushed by another process's release (`scripts.handover.HAND_OVER`) as
    ``b"<token> <fence>"``; :meth:`parse` reads it."""

    token: bytes
    fence: int

    @classmethod
    def parse(cls, message: bytes | str) -> HandOver:
        """The hand-over a hub popped (str from a client that decodes responses)."""
        raw = message.encode() if isinstance(message, str) else message
        token, _, fence = raw.rpartition(b" ")  # a token may hold spaces, a fence never does
        return cls(token=token, fence=int(fence))


class _Waiter:
    __slots__ = ("event", "fence")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.fence: int | None = None


class WakeHub:
    """Receives the lock hand-overs of this process's waiters on one list and one connection.

    A waiter registers its token with the hub before it queues; its queue entry names the hub's
    list, so the release that hands it the lock pushes a :class:`HandOver` there; the hub's
    thread pops it and sets the waiter's event. Waiting costs a waiter no connection: it uses
    the client's pool only for its short scripts (queueing, renewing its entry after each wait
    slice, withdrawing). A wake the hub misses (its connection dropped with the reply in flight,
    its thread late) is found by the waiter's next queueing script, at the end of its wait
    slice, which sees the lock holding its token, as it does without a hub.

    ``client`` is the Redis the locks live on; the hub opens one connection of its own to it,
    with the same connection settings, outside the client's pool (so it never takes one of
    the pool's connections away from a holder). ``prefix`` names the hub's list.
    """

    def __init__(self, client: Any, prefix: str = "locking:wakes") -> None:
        pool = client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        self.key = f"{prefix}:{uuid.uuid4().hex}".encode()
        socket_timeout = kwargs.get("socket_timeout")
        self.slice = min(DEFAULT_SLICE, socket_timeout / 2) if socket_timeout else DEFAULT_SLICE
        self._redis = redis.Redis(
            connection_pool=redis.ConnectionPool(
                connection_class=pool.connection_class, max_connections=1, **kwargs
            )
        )
        self._waiters: dict[bytes, _Waiter] = {}
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Wakes popped from the list (a waiter that gave up may no longer be there for one).
        self.delivered = 0

    def register(self, token: bytes) -> None:
        """Be told of a hand-over to `token` from now on (call it before queueing)."""
        with self._mutex:
            self._waiters[token] = _Waiter()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"lock-wake-hub:{self.key.decode()}", daemon=True
                )
                self._thread.start()

    def unregister(self, token: bytes) -> None:
        with self._mutex:
            self._waiters.pop(token, None)

    def wait(self, token: bytes, seconds: float) -> int | None:
        """Wait up to `seconds` for the lock to be handed to `token`: its fence, else None."""
        waiter = self._waiters.get(token)
        if waiter is None:
            raise RuntimeError("wait() for a token that is not registered")
        if not waiter.event.wait(max(seconds, 0.0)):
            return None
        waiter.event.clear()
        fence, waiter.fence = waiter.fence, None
        return fence

    def close(self) -> None:
        """Stop the hub's thread and close its connection (tests; a process just exits)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.slice + 5)
        self._redis.close()

    def _run(self) -> None:
        backoff = 0.01
        while not self._stop.is_set():
            try:
                popped = self._redis.blpop([self.key], timeout=round(self.slice, 3))
            except RedisTimeoutError:
                continue  # the socket timed out before the BLPOP did: no wake came
            except RedisError as exc:
                # Redis is away: waiters carry on by their wait slices meanwhile.
                logger.info("lock wake hub %s: %s; trying again", self.key.decode(), exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            backoff = 0.01
            if popped is not None:
                _list, message = popped
                self._deliver(HandOver.parse(message))

    def _deliver(self, hand_over: HandOver) -> None:
        with self._mutex:
            waiter = self._waiters.get(hand_over.token)
            self.delivered += 1
            if waiter is None:
                # Its waiter gave up (its withdrawal kept a lock handed over just before).
                return
            waiter.fence = hand_over.fence
            waiter.event.set()


class HubWoken(FifoHandOver):
    """The hand-over lock whose waiters wait through their process's :class:`WakeHub`.

    Contract, beside :class:`~locking.handover.FifoHandOver`'s: a waiter registers its token
    with the hub of ``hub_prefix`` before it queues, and its queue entry names the hub's list,
    ``<hub_prefix>:<hub id>``: the release pushes the hand-over there and the hub's one
    connection wakes the waiter in-process. A waiter holds no connection while it waits, so a
    thousand waiters do not need a thousand connections, and a bounded pool always has one
    for the holder's release. FIFO order, wait slices and the give-up rules are the same. It
    needs a single Redis (ValueError on a cluster).
    """

    # The hub's wait is an in-process event, on time: no wait is slept on the client.
    sleeps_short_waits = False

    def __init__(self, *args: Any, hub_prefix: str = "locking:wakes", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if is_cluster(self.redis):
            raise ValueError(
                "the wake hub needs a single Redis: the hub's one list cannot share the slot "
                "of every lock a process waits for"
            )
        self.hub_prefix = hub_prefix

    def _grant(
        self, token: bytes, blocking: bool, blocking_timeout: Number | None, sleep: Number
    ) -> int | None:
        if not blocking:
            return super()._grant(token, blocking, blocking_timeout, sleep)  # one take
        hub = hub_for(self.redis, self.hub_prefix)
        hub.register(token)  # before queueing: no hand-over can come sooner
        try:
            return self._wait_in_turn(token, blocking_timeout, hub.key)
        finally:
            hub.unregister(token)

    def _wait_for_handoff(self, token: bytes, seconds: float) -> int | None:
        return hub_for(self.redis, self.hub_prefix).wait(token, round(max(seconds, MIN_WAIT), 3))


_hubs: dict[tuple[int, str], WakeHub] = {}
_hubs_lock = threading.Lock()
_hubs_pid = os.getpid()


def hub_for(client: Any, prefix: str = "locking:wakes") -> WakeHub:
    """This process's hub for the Redis of `client`'s pool (one per pool and prefix)."""
    global _hubs_pid
    with _hubs_lock:
        if _hubs_pid != os.getpid():
            _hubs.clear()  # a forked child: the parent's hubs' threads are not here
            _hubs_pid = os.getpid()
        pool = client.connection_pool
        key = (id(pool), prefix)
        hub = _hubs.get(key)
        if hub is None:
            hub = _hubs[key] = WakeHub(client, prefix)
            # A pool that goes away takes its hub with it (and frees its id for reuse).
            weakref.finalize(pool, _forget, key, hub)
        return hub


def _forget(key: tuple[int, str], hub: WakeHub) -> None:
    with _hubs_lock:
        if _hubs.get(key) is hub:
            del _hubs[key]
    hub._stop.set()
