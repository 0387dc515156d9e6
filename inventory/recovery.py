"""What a process does once Redis answers again after an outage (the breaker's probe), wired
into the Redis breaker by `InventoryConfig.ready()`."""

from __future__ import annotations

from .breaker import redis_recovery, release_unsettled_locks
from .models import Item
from .strategies import get_strategy


def rebuild_redis_state() -> None:
    """Set every item's Redis counters and shards from the database."""
    for item in Item.objects.exclude(current_sale=None):
        get_strategy(item.strategy).sync_redis(item=item)


def wire() -> None:
    """Release the locks a failure left in doubt, then rebuild the counters (once)."""
    for step in (release_unsettled_locks, rebuild_redis_state):
        if step not in redis_recovery:
            redis_recovery.append(step)
