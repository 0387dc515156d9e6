"""Recovering from a fault repairs the counters it may have left wrong, without waiting for the
periodic reconciler, and the sale's audit says what was repaired, when and by whom: Redis back
after an outage, a web process starting, the reconciler (real PostgreSQL, Redis, web server)."""

from __future__ import annotations

import io

import psycopg
import pytest
from django.core.management import CommandError, call_command
from redis.exceptions import ConnectionError as RedisConnectionError

from inventory import keys
from inventory.breaker import breaker
from inventory.models import Item
from inventory.orders import RECONCILE_LOCK
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies.counters import counter
from inventory.tasks import reconcile_sales_task
from tests.conftest import start_shop, test_database_url, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _lua_sale_short_in_redis(sku: str) -> Item:
    """A lua sale of 20 with 3 sold, whose Redis counters lost 2 more units, as a web process
    that died between its take and its commit leaves them: Redis says 15, the database 17."""
    start_sale(sku=sku, stock=20, strategy="lua")
    for n in range(3):
        place_order(sku=sku, qty=1, buyer=f"b{n}")
    item = Item.objects.get(sku=sku)
    levels = counter().get_many(keys.stripe_counters(item))
    index = next(i for i, level in enumerate(levels) if (level or 0) >= 2)
    counter().take(keys.stripe_counter(item, index), 2)
    audit = audit_sale(sku)
    assert (audit["db_stock"], audit["redis_stock"], audit["consistent"]) == (17, 15, False)
    assert audit["repairs"] == []
    return item


def test_redis_back_after_an_outage_repairs_the_counters_and_the_audit_says_so():
    # Given a sale Redis holds 2 units short of, and this process's breaker open (an outage)
    _lua_sale_short_in_redis("back-repaired")
    breaker.record_failure(RedisConnectionError("gone"))

    # When Redis answers its probe again
    breaker.probe_soon()
    breaker.settle(timeout=30)

    # Then the breaker is closed only once the counters agree with the database again
    assert not breaker.is_open
    audit = audit_sale("back-repaired")
    assert audit["redis_stock"] == audit["db_stock"] == 17 and audit["consistent"], audit
    # and the audit says what was repaired, and why
    (repair,) = audit["repairs"]
    assert repair["cause"] == "redis_back"
    assert repair["changes"] == ["back-repaired: Redis stock 15 -> 17"]


def test_a_web_process_that_starts_repairs_the_sales_that_sold_lately():
    # Given a sale Redis holds 2 units short of (its process died mid-sale)
    _lua_sale_short_in_redis("start-repaired")

    # When a web server starts (its processes come up)
    server = start_shop()
    try:
        # Then, with no checkout and no reconciler, the counters are put right
        assert wait_until(lambda: audit_sale("start-repaired")["consistent"], timeout=60)
    finally:
        server.stop()
    audit = audit_sale("start-repaired")
    assert audit["redis_stock"] == 17, audit
    # and the audit names the repair once (the other processes found nothing left to do)
    assert [repair["cause"] for repair in audit["repairs"]] == ["process_start"]
    assert audit["repairs"][0]["changes"] == ["start-repaired: Redis stock 15 -> 17"]


def test_the_reconciler_s_repairs_are_listed_too_and_a_pass_with_nothing_to_do_is_not():
    _lua_sale_short_in_redis("reconciled")

    reconcile_sales_task()
    reconcile_sales_task()  # nothing left to repair: no second entry

    audit = audit_sale("reconciled")
    assert audit["consistent"]
    assert [repair["cause"] for repair in audit["repairs"]] == ["reconciler"]
    # and the audit's text names it as a reader reads it
    out = io.StringIO()
    call_command("sale", "audit", "reconciled", stdout=out)
    line = next(line for line in out.getvalue().splitlines() if line.startswith("repairs"))
    assert "(reconciler): reconciled: Redis stock 15 -> 17" in line, line


def test_a_repair_under_way_elsewhere_is_neither_waited_for_nor_done_twice():
    # Given a sale Redis is short of, which another process is repairing at this moment (it
    # holds the sale's repair lock, as a repair stuck on a stalled dependency would)
    _lua_sale_short_in_redis("repair-elsewhere")
    other = psycopg.connect(test_database_url(), autocommit=True)
    try:
        other.execute(
            "SELECT pg_advisory_lock(%s, hashtext(%s))", [RECONCILE_LOCK, "repair-elsewhere"]
        )

        # When this process's reconciler, and an operator, repair it too
        # Then neither waits: the reconciler leaves it to the other, and the command says so
        assert reconcile_sales_task() == []
        with pytest.raises(CommandError, match="another process is repairing this sale"):
            call_command("sale", "reconcile", "repair-elsewhere", stdout=io.StringIO())
        audit = audit_sale("repair-elsewhere")
        assert (audit["redis_stock"], audit["repairs"]) == (15, [])
    finally:
        other.close()

    # and once the other is done, the next pass repairs it, once
    assert reconcile_sales_task() == ["repair-elsewhere: Redis stock 15 -> 17"]
    audit = audit_sale("repair-elsewhere")
    assert audit["consistent"] and len(audit["repairs"]) == 1, audit
