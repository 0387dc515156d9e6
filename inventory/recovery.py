"""Recovering from a fault repairs what the fault may have left wrong, without waiting for the
periodic reconciler: once Redis answers again after an outage (the breaker's probe, wired into
the Redis breaker by `InventoryConfig.ready()`), and as a web process starts (a process that
died between its take in Redis and its commit left Redis short of the units it took). Each
repair that changed anything is recorded, and the sale's audit lists it (`SaleRepair`)."""

from __future__ import annotations

import logging
import threading
from contextlib import suppress
from datetime import timedelta

from django.db import connections
from django.db.models import Q
from django.utils import timezone

from .breaker import redis_recovery, release_unsettled_locks
from .models import Item, Order, SaleRepair
from .orders import RepairInProgress, reconcile_sale
from .strategies import get_strategy

logger = logging.getLogger(__name__)

#: A process that starts repairs the sales that sold this recently (a process that died in
#: the meantime was selling them).
RECENT = timedelta(minutes=15)


def rebuild_redis_state() -> None:
    """Repair every current sale against the database (recording what was wrong), then set
    its Redis counters and hints from the database."""
    for item in Item.objects.exclude(current_sale=None):
        with suppress(RepairInProgress):  # another process repairs it now
            reconcile_sale(item.sku, cause=SaleRepair.Cause.REDIS_BACK)
        get_strategy(item.strategy).sync_redis(item=item)


def repair_recent_sales() -> list[str]:
    """Repair the current sales that sold in the last RECENT, or started in it: what a web
    process runs as it starts. Returns the changes made."""
    since = timezone.now() - RECENT
    sold = Order.objects.filter(created_at__gte=since).values("sale_id")
    skus = (
        Item.objects.exclude(current_sale=None)
        .filter(Q(current_sale__started_at__gte=since) | Q(current_sale_id__in=sold))
        .values_list("sku", flat=True)
    )
    changes: list[str] = []
    for sku in skus:
        with suppress(RepairInProgress):  # another process, starting too, repairs it now
            changes += reconcile_sale(sku, cause=SaleRepair.Cause.PROCESS_START)
    return changes


def repair_in_the_background() -> threading.Thread:
    """`repair_recent_sales` in a thread of its own: a process starting answers meanwhile."""

    def run() -> None:
        try:
            for change in repair_recent_sales():
                logger.warning("repaired as this process started: %s", change)
        except Exception:  # a database or Redis still away: the reconciler comes later
            logger.exception("the repair as this process started failed")
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="repair-on-start", daemon=True)
    thread.start()
    return thread


def wire() -> None:
    """Release the locks a failure left in doubt, then rebuild the counters (once)."""
    for step in (release_unsettled_locks, rebuild_redis_state):
        if step not in redis_recovery:
            redis_recovery.append(step)
