"""The shop's Redis key layout, in one place. Every key is `<FLASHSALE_REDIS_PREFIX>:...`:

    lock:item:<sku>                         `lock`'s lock of the item (locking.Lock adds its own
                                            suffixes, e.g. its wake-up list)
    lock:item:<sku>:shard:<i>               `segmented`'s lock of shard i
    item:<sku>:sale:<id>:row:<i>            what Redis believes stock row i of sale <id> holds
                                            (`segmented`'s hints; `lua` decides by them)
    item:<sku>:sale:<id>:turn               `lua`'s cursor over the rows
    item:<sku>:sale:<id>:claim:<key>        a `lua` checkout's claim on its idempotency key
    item:<sku>:sale:<id>:commits            group commit: the queued sales,
    item:<sku>:sale:<id>:combiner           the combiner lock,
    item:<sku>:sale:<id>:answer:<request>   each sale's answer
    order:<pk>:returned                     set once a failed order's units are back in Redis

Whatever belongs to one sale lives under `item:<sku>:sale:<id>:`, so a restarted sale never
meets its predecessor's keys and `stale_sale_keys` finds them to delete.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from django.conf import settings

if TYPE_CHECKING:
    from .models import Item


def key(*parts: object) -> str:
    """A namespaced key: `<FLASHSALE_REDIS_PREFIX>:part:part...`."""
    return ":".join([settings.FLASHSALE_REDIS_PREFIX, *map(str, parts)])


def item_lock(item: Item) -> str:
    return key("lock", "item", item.sku)


def shard_locks(item: Item) -> list[str]:
    return list(_shard_locks(settings.FLASHSALE_REDIS_PREFIX, item.sku, item.shard_count))


def sale_key(item: Item, *parts: object) -> str:
    """A key of item's current sale: `<prefix>:item:<sku>:sale:<id>:<parts...>`."""
    return key("item", item.sku, "sale", item.current_sale_id, *parts)


def row(item: Item, index: int) -> str:
    return sale_key(item, "row", index)


def rows(item: Item) -> list[str]:
    return list(
        _rows(settings.FLASHSALE_REDIS_PREFIX, item.sku, item.current_sale_id, item.shard_count)
    )


def turn(item: Item) -> str:
    return sale_key(item, "turn")


def claim(item: Item, idempotency_key: str) -> str:
    return sale_key(item, "claim", idempotency_key)


def commits(item: Item) -> str:
    return sale_key(item, "commits")


def combiner(item: Item) -> str:
    return sale_key(item, "combiner")


def answer_prefix(item: Item) -> str:
    return sale_key(item, "answer", "")


def returned_marker(order_pk: int) -> str:
    """Set once an order's units are back in Redis, so a retried give-back adds nothing."""
    return key("order", order_pk, "returned")


def current_sale_prefix(item: Item) -> str:
    return sale_key(item, "")


def every_sale_pattern(item: Item) -> str:
    """A SCAN pattern matching the keys of every sale of the item, the current one included."""
    return key("item", item.sku, "sale", "*")


# Built once per sale (`prefix` keys the caches: `key` reads the same setting), since a
# checkout names every row's key, or every shard's lock.


@lru_cache(maxsize=1024)
def _rows(prefix: str, sku: str, sale_id: int | None, count: int) -> tuple[str, ...]:
    return tuple(key("item", sku, "sale", sale_id, "row", index) for index in range(count))


@lru_cache(maxsize=1024)
def _shard_locks(prefix: str, sku: str, count: int) -> tuple[str, ...]:
    return tuple(key("lock", "item", sku, "shard", index) for index in range(count))
