"""Redis counters that mirror a sale's stock rows, shared by `segmented` and `lua`.

One counter per stock row of the current sale, `<prefix>:item:<sku>:sale:<id>:row:<index>`:
what Redis believes row `index` holds. Keyed by sale, so a restarted sale never meets a
counter left by the previous one. `segmented` keeps them as hints (set from the database by
the lock holder after each commit); `lua` decides with them (its script takes units from them
before the database write).
"""

from __future__ import annotations

from functools import lru_cache

from django.conf import settings

from locking import StockCounter
from locking.combining import GroupCommit

from ..models import Item, Order
from ..redis_client import get_redis_client, redis_key
from ..stock import shard_stocks


def sale_key(item: Item, *parts: object) -> str:
    """A key of item's current sale: `<prefix>:item:<sku>:sale:<id>:<parts...>`."""
    return redis_key("item", item.sku, "sale", item.current_sale_id, *parts)


def row_key(item: Item, index: int) -> str:
    return sale_key(item, "row", index)


def row_keys(item: Item) -> list[str]:
    return list(
        _row_keys(settings.FLASHSALE_REDIS_PREFIX, item.sku, item.current_sale_id, item.shard_count)
    )


@lru_cache(maxsize=1024)
def _row_keys(prefix: str, sku: str, sale_id: int | None, count: int) -> tuple[str, ...]:
    # Built once per sale (`prefix` keys the cache: redis_key reads the same setting), since a
    # checkout names every row's key.
    return tuple(redis_key("item", sku, "sale", sale_id, "row", index) for index in range(count))


def returned_marker(order: Order) -> str:
    """Set once an order's units are back in Redis, so a retried give-back adds nothing."""
    return redis_key("order", order.pk, "returned")


def counter() -> StockCounter:
    return _counter(get_redis_client())


@lru_cache(maxsize=16)
def _counter(client: object) -> StockCounter:
    # One per client: building one registers its scripts.
    return StockCounter(client)


def group_commit(item: Item) -> GroupCommit:
    """The queue and combiner lock through which `lua` writes item's sales in batches."""
    return GroupCommit(
        get_redis_client(),
        queue=sale_key(item, "commits"),
        lock=sale_key(item, "combiner"),
        reply_prefix=sale_key(item, "answer", ""),
        lock_ttl_ms=settings.FLASHSALE_LOCK_TTL_MS,
        batch=settings.FLASHSALE_GROUP_COMMIT_BATCH,
    )


def write_rows(item: Item, levels: dict[int, int]) -> list[int]:
    """Set the counters of the rows in `levels`; return every row's level (0 where not given)."""
    counter().set_many({row_key(item, index): units for index, units in levels.items()})
    return [levels.get(index, 0) for index in range(item.shard_count)]


def sync_rows(item: Item) -> list[int]:
    """Set every row's counter from the database."""
    return write_rows(item, shard_stocks(item.current_sale_id))


def add_to_rows(item: Item, units: dict[int, int]) -> None:
    """Raise the counters of the rows in `units` by that many (a restock; missing counters stay
    missing: they are seeded from the database, which has the units already)."""
    amounts = {row_key(item, index): added for index, added in units.items() if added}
    if amounts:
        counter().give_back_many(amounts)


def give_back_rows(item: Item, order: Order) -> None:
    """Add a failed or expired order's units back to the counters it took them from, once."""
    amounts = {
        row_key(item, int(index)): units for index, units in (order.shard_units or {}).items()
    }
    if amounts:
        counter().give_back_once(returned_marker(order), amounts)


def rows_total(item: Item) -> int | None:
    """Units the counters hold together; None when a counter is missing."""
    if not item.shard_count:
        return None
    levels = counter().get_many(row_keys(item))
    return None if None in levels else sum(levels)
