"""The shop's Redis key layout, in one place: every key is `<FLASHSALE_REDIS_PREFIX>:...`, laid
out as the table below says.

The braces are Redis Cluster hash tags: only the text inside them picks a key's slot, so every
key one script touches shares one. A lock shares its slot with its own helper keys; a
`segmented` shard's lock with its hint, each shard a slot of its own, so that a hot item's
shards spread over a cluster's masters; everything of a `lua` sale (its counters, its cursor,
its claims, its give-back markers) shares the sale's slot, since one script takes from all its
counters. On a single Redis the braces are just characters. Whatever belongs to one sale lives
under `item:<sku>:sale:<id>:`, so a restarted sale never meets its predecessor's keys and
`every_sale_pattern` finds them to delete.
"""

# lock:{item:<sku>}                       `lock`'s lock of the item (`item_lock`; locking.Lock
#                                         adds its own suffixes, e.g. its queue and fence)
# lock:{item:<sku>:shard:<i>}             `segmented`'s lock of shard i (`shard_locks`)
# item:<sku>:sale:<id>:row:{item:<sku>:shard:<i>}
#                                         `segmented`'s hint of stock row i of sale <id> (what
#                                         Redis believes the row holds), and its version
#                                         (`shard_hints`)
# item:<sku>:sale:<id>:{<sku>:<id>}:row:<i>
#                                         `lua`'s counter of stock row i, which it decides by
#                                         (`stripe_counters`)
# item:<sku>:sale:<id>:{<sku>:<id>}:turn  `lua`'s cursor over the rows (`turn`)
# item:<sku>:sale:<id>:{<sku>:<id>}:claim:<key>
#                                         a `lua` checkout's claim on its idempotency key
# item:<sku>:sale:<id>:{<sku>:<id>}:returned:<order>
#                                         set once a failed order's units are back in Redis
# item:<sku>:sale:<id>:{<sku>:<id>}:holders, :generation
#                                         the processes holding `lua` units taken ahead, and
#                                         how often the counters were set under them
# item:<sku>:sale:<id>:{<sku>:<id>}:gone, :additions
#                                         `lock`'s sold-out mark (`<additions>:<units left>`)
#                                         and the count of additions to the item row that
#                                         voids every mark made before it

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
    return key("lock", f"{{item:{item.sku}}}")


def shard_locks(item: Item) -> list[str]:
    return list(_shard_locks(settings.FLASHSALE_REDIS_PREFIX, item.sku, item.shard_count))


def sale_key(item: Item, *parts: object) -> str:
    """A key of item's current sale, in the sale's slot:
    `<prefix>:item:<sku>:sale:<id>:{<sku>:<id>}:<parts...>`."""
    return _in_sale(item.sku, item.current_sale_id, *parts)


def _in_sale(sku: str, sale_id: int | None, *parts: object) -> str:
    return key("item", sku, "sale", sale_id, f"{{{sku}:{sale_id}}}", *parts)


def stripe_counter(item: Item, index: int) -> str:
    return stripe_counters(item)[index]


def stripe_counters(item: Item) -> list[str]:
    """`lua`'s counters of the current sale's stock rows, all in the sale's slot (one script
    takes from them all)."""
    prefix = settings.FLASHSALE_REDIS_PREFIX
    return list(_stripe_counters(prefix, item.sku, item.current_sale_id, item.shard_count))


def shard_hint(item: Item, index: int) -> str:
    return shard_hints(item)[index]


def shard_hints(item: Item) -> list[str]:
    """`segmented`'s hints of the current sale's stock rows, each in a slot of its own with its
    shard's lock (one script takes a shard's lock and reads its hint)."""
    prefix = settings.FLASHSALE_REDIS_PREFIX
    return list(_shard_hints(prefix, item.sku, item.current_sale_id, item.shard_count))


def turn(item: Item) -> str:
    return _turn(settings.FLASHSALE_REDIS_PREFIX, item.sku, item.current_sale_id)


@lru_cache(maxsize=1024)
def _turn(prefix: str, sku: str, sale_id: int | None) -> str:
    return _in_sale(sku, sale_id, "turn")


def claim(item: Item, idempotency_key: str) -> str:
    return sale_key(item, "claim", idempotency_key)


def holders(item: Item) -> str:
    """The processes holding units of the current sale taken ahead of their checkouts, each
    with when its lease ends (`inventory.strategies.ahead`; in the sale's slot)."""
    return sale_key(item, "holders")


def generation(item: Item) -> str:
    """How many times `lua`'s counters of the current sale were set from the database: units
    taken ahead in an earlier generation are not given back (in the sale's slot)."""
    return sale_key(item, "generation")


def returned_marker(item: Item, order_pk: int) -> str:
    """Set once an order's units are back in Redis, so a retried give-back adds nothing (in
    the sale's slot, with the counters it adds to)."""
    return sale_key(item, "returned", order_pk)


def current_sale_prefix(item: Item) -> str:
    """What every key of item's current sale starts with (in whichever slot it lives)."""
    return key("item", item.sku, "sale", item.current_sale_id, "")


def every_sale_pattern(item: Item) -> str:
    """A SCAN pattern matching the keys of every sale of the item, the current one included."""
    return key("item", item.sku, "sale", "*")


# Built once per sale (`prefix` keys the caches: `key` reads the same setting), since a
# checkout names every row's key, or every shard's lock.


@lru_cache(maxsize=1024)
def _stripe_counters(prefix: str, sku: str, sale_id: int | None, count: int) -> tuple[str, ...]:
    return tuple(_in_sale(sku, sale_id, "row", index) for index in range(count))


@lru_cache(maxsize=1024)
def _shard_hints(prefix: str, sku: str, sale_id: int | None, count: int) -> tuple[str, ...]:
    return tuple(
        key("item", sku, "sale", sale_id, "row", _shard_tag(sku, index)) for index in range(count)
    )


@lru_cache(maxsize=1024)
def _shard_locks(prefix: str, sku: str, count: int) -> tuple[str, ...]:
    return tuple(key("lock", _shard_tag(sku, index)) for index in range(count))


def _shard_tag(sku: str, index: int) -> str:
    return f"{{item:{sku}:shard:{index}}}"
