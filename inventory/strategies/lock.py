"""`lock`: one Redis lock per item around a guarded database update."""

from __future__ import annotations

from typing import NamedTuple

from django.conf import settings

from locking.scripts import script_for

from .. import keys, metrics
from ..exceptions import Busy, LockLost, SoldOut
from ..models import Item, Order
from ..redis_client import get_redis_client
from ..sale_values import Allocation, Fenced
from ..stock import read_stock
from .base import RecordOrder, StockStrategy
from .locks import acquire_lock, ensure_still_held, fence_of, new_lock, release_quietly
from .waits import simulate_work


class LockStrategy(StockStrategy):
    """One Redis lock per item; under it, the guarded write of the sale.

    The lock makes contention cheap: buyers queue in Redis, not on the item row. The write
    under it is still guarded (`stock >= qty`), so a holder whose lock expired mid-work, or the
    database fallback writing from outside the lock while Redis recovers, cannot oversell; and
    fenced (the lock's fencing token, which the row refuses once a later holder has written),
    so a holder paused past its lock's TTL cannot write at all when it wakes.

    Its units live in the item row alone. A checkout this process's last read says is sold out
    asks Redis before the database: the first to find the row short marks the sale gone in
    Redis (`_GONE_MARK`), and later ones, in every process, are answered from that mark with no
    database round trip. Whatever adds units to the row (a failed order's give-back, a restock,
    a repair, Redis rebuilt after an outage) counts one more addition (`_units_back`), which
    voids every mark made before it; a checkout marks only if no addition came since it looked,
    so no mark outlives the units it says are gone.
    """

    name = "lock"
    label = "one Redis lock per item"
    uses_redis = True
    holds_locks = True
    # Its write refuses a sale restarted since the item was read, and the stock it checks
    # before taking the lock is only a shortcut (kept up to date by each sale of this process,
    # checked against the sale's mark or the database before a sold-out answer).
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        # The stock read with the item (or left by the last sale of this process), no decision:
        # it spares the lock once the item is gone. A remembered read may be old, so "gone" is
        # answered from the sale's mark in Redis, or else read again from the database (and
        # marked) before it is answered.
        if item.stock < qty:
            mark, additions = self._gone(item)
            if mark is not None and mark < qty:
                item.stock = mark
                raise SoldOut(sku=item.sku, requested=qty, remaining=mark)
            item.stock = read_stock(item.pk).stock
            if item.stock < qty:
                self._mark_gone(item, item.stock, additions)
                raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        lock = new_lock(keys.item_lock(item), strategy=self.name, quorum=True, peers=True)
        # The sale's statement is built and a cursor opened before the lock is asked for: the
        # lock is held for the statement's round trip and little else.
        with record.prepare(Allocation(strategy=self.name)) as write:
            if not acquire_lock(lock):
                raise Busy(
                    f"{item.sku}: lock still held after {settings.FLASHSALE_LOCK_WAIT_MS} ms",
                )
            try:
                simulate_work()
                ensure_still_held(lock, item.sku)
                sold = write(fence=fence_of(lock))
            except Fenced as refused:
                metrics.LOCKS_LOST.labels(self.name, "fenced").inc()
                raise LockLost(
                    f"lock lost before commit: {refused}",
                ) from None
            finally:
                release_quietly(lock)
        if sold is None:
            item.stock = read_stock(item.pk).stock
            raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        if sold.item_stock is not None:
            item.stock = sold.item_stock  # what a checkout using this item read next will see
        return sold.order

    # -- the sold-out mark --------------------------------------------------------------------

    @staticmethod
    def _gone(item: Item) -> MarkRead:
        """What the sale's mark says now, and the additions counted so far."""
        stored_mark, stored_additions = get_redis_client().mget(_gone_keys(item))
        additions = int(stored_additions or 0)
        if stored_mark is None:
            return MarkRead(units_left=None, additions=additions)
        mark = GoneMark.parse(stored_mark)
        units_left = mark.units_left if mark.additions == additions else None
        return MarkRead(units_left=units_left, additions=additions)

    @staticmethod
    def _mark_gone(item: Item, left: int, additions: int) -> None:
        """Mark the sale gone with `left` units, unless units were added since `additions`
        was read (then the read that found it short may be older than they are)."""
        client = get_redis_client()
        script_for(client, _GONE_MARK)(keys=_gone_keys(item), args=[additions, left], client=client)

    @staticmethod
    def _units_back(item: Item) -> None:
        """Units came back to the item row (committed already): void every mark made before."""
        get_redis_client().incr(_gone_keys(item)[1])

    def sync_redis(self, *, item: Item, force: bool = False) -> None:
        self._units_back(item)

    def return_units(self, *, item: Item, order: Order) -> None:
        self._units_back(item)

    def add_units(self, *, item: Item, units: int, rows: dict[int, int]) -> None:
        self._units_back(item)


class GoneMark(NamedTuple):
    """The sale's sold-out mark as a checkout stored it (`_GONE_MARK`:
    ``b"<additions>:<units left>"``), which checkouts in every process read."""

    #: The count of additions to the item row when the mark was made: a later one voids it.
    additions: int
    #: The units the checkout that made it found left.
    units_left: int

    @classmethod
    def parse(cls, stored: bytes) -> GoneMark:
        additions, _, units_left = stored.partition(b":")
        return cls(additions=int(additions), units_left=int(units_left))


class MarkRead(NamedTuple):
    """What `LockStrategy._gone` found."""

    #: The units a mark made since the last addition says are left; None: no such mark.
    units_left: int | None
    #: The additions counted so far: what `_mark_gone` must still find to mark.
    additions: int


def _gone_keys(item: Item) -> list[str]:
    """The sale's sold-out mark and its count of additions, in the sale's slot."""
    return [keys.sale_key(item, "gone"), keys.sale_key(item, "additions")]


#: Mark a sale gone: KEYS the mark and the additions; ARGV the additions as the checkout read
#: them (0 for none) and the units it found left. Marks only if no addition came since; the
#: mark reads back as `GoneMark`.
_GONE_MARK = """
local additions = redis.call('GET', KEYS[2]) or '0'
if additions ~= ARGV[1] then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2])
return 1
"""
