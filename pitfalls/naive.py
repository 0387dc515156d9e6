"""The lock code the articles warn about, kept here to show what it does.

Nothing outside the pitfall lab imports this module, and no checkout can reach it: the shop's
lock is `locking.Lock`, and its `lock` strategy writes through the guarded sale statement. Each
function is one of the hand-written locks the articles take apart, with the hook a scenario
needs to force the interleaving that breaks it (`between`: called between two commands that
should have been one); `TrustingLockStrategy` is `lock` writing back the stock it read, and
`UnfencedLock` the shop's lock without its fencing token (a watchdog lock, and nothing more).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import redis

from inventory import keys
from inventory.exceptions import Busy, SoldOut
from inventory.models import Item, Order
from inventory.sale_values import Allocation
from inventory.stock import read_stock
from inventory.strategies.base import RecordOrder
from inventory.strategies.lock import LockStrategy
from inventory.strategies.locks import acquire_lock, new_lock, release_quietly
from inventory.strategies.waits import simulate_work
from locking import Lock


def setnx_then_expire(
    client: redis.Redis, name: str, token: str, ttl_seconds: int, between: Callable[[], None]
) -> bool:
    """`SETNX`, then `EXPIRE` in a second command: a client that dies in between leaves a lock
    that never expires."""
    if not client.setnx(name, token):
        return False
    between()
    client.expire(name, ttl_seconds)
    return True


def spin_acquire(
    client: redis.Redis,
    name: str,
    *,
    ttl_ms: int,
    wait_seconds: float,
    sleep_seconds: float,
    token: str | None = None,
) -> str | None:
    """`SET NX PX` with a fresh token on every try, sleeping between tries, until `wait_seconds`
    have passed; a try that times out on the client counts as failed. The token, or None."""
    deadline = time.monotonic() + wait_seconds
    while True:
        attempt = token or uuid.uuid4().hex
        try:
            if client.set(name, attempt, nx=True, px=ttl_ms):
                return attempt
        except redis.exceptions.TimeoutError:
            pass  # "the lock call failed": but the SET may have run on the server
        if time.monotonic() >= deadline:
            return None
        time.sleep(sleep_seconds)


def delete_release(client: redis.Redis, name: str) -> None:
    """`DEL`, whoever holds the lock now."""
    client.delete(name)


def get_then_delete_release(
    client: redis.Redis, name: str, token: str, between: Callable[[], None]
) -> bool:
    """`GET`, compare, then `DEL` in a second command: the lock may change hands in between."""
    stored = client.get(name)
    if stored not in (token, token.encode()):
        return False
    between()
    client.delete(name)
    return True


class TrustingLockStrategy(LockStrategy):
    """`lock` that trusts its lock: under it, it reads the stock and writes back what it read
    minus the quantity, an absolute value with no guard. Correct only while the lock never
    expires under a holder that still works."""

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        lock = new_lock(keys.item_lock(item), strategy=self.name)
        if not acquire_lock(lock):
            raise Busy(f"{item.sku}: lock still held")
        try:
            seen = read_stock(item.pk).stock
            if seen < qty:
                raise SoldOut(sku=item.sku, requested=qty, remaining=seen)
            simulate_work()
            sold = record(Allocation(strategy=self.name, set_stock=seen - qty))
        finally:
            release_quietly(lock)
        if sold is None:
            raise RuntimeError(f"{item.sku}: the unguarded write was refused")
        return sold.order


class UnfencedLock(Lock):
    """The shop's lock, watchdog and all, handing out no fencing token: the lock the articles
    stop at. A holder paused past its TTL wakes up, and its write goes through."""

    @property
    def fence(self) -> int | None:
        return None
