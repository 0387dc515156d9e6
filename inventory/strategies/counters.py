"""The Redis counters that mirror a sale's stock rows, one per row: `lua`'s stripe counters,
which it decides by, and `segmented`'s shard hints, copies of each row's level and version.
Each strategy names its own keys (`inventory.keys`) and keeps its counters true itself.
"""

from __future__ import annotations

from functools import lru_cache

from locking import StockCounter
from locking.holders import Holders

from ..redis_client import get_redis_client


def counter() -> StockCounter:
    """The stock counter of the shop's Redis client (`locking.StockCounter`: its scripts)."""
    return _counter(get_redis_client())


@lru_cache(maxsize=16)
def _counter(client: object) -> StockCounter:
    # One per client: building one registers its scripts.
    return StockCounter(client)


def holder_registry() -> Holders:
    """The registry of processes holding units taken ahead, on the shop's Redis client."""
    return _holders(get_redis_client())


@lru_cache(maxsize=16)
def _holders(client: object) -> Holders:
    return Holders(client)


def total(names: list[str]) -> int | None:
    """Units the counters named hold together; None when one is missing."""
    if not names:
        return None
    levels = counter().get_many(names)
    held = [level for level in levels if level is not None]
    return sum(held) if len(held) == len(levels) else None
