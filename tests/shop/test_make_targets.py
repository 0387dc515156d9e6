"""`make sale` and `make admin`: what a newcomer types beside `make serve`, run for real."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from django.contrib.auth.models import User

from inventory.models import Item
from inventory.selectors import audit_sale
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)


def _make(*arguments: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *arguments],
        cwd=ROOT,
        env={**os.environ, **server_env(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_make_sale_starts_a_sale_the_shop_sells_from_redis_and_all():
    sku = f"made-{uuid.uuid4().hex[:6]}"
    done = _make("sale", f"SKU={sku}", "STOCK=7", "LIMIT=2", "PRICE=4.50")
    assert done.returncode == 0, done.stderr
    item = Item.objects.get(sku=sku)
    assert (item.strategy, item.per_buyer_limit, str(item.price)) == ("lua", 2, "4.50")
    audit = audit_sale(sku)
    assert audit["db_stock"] == audit["redis_stock"] == 7 and audit["consistent"], audit


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["SKU=half-told"], "usage: make sale SKU="),
        (["SKU=bad-stock", "STOCK=many"], "stock"),
        (["SKU=bad-strategy", "STOCK=3", "STRATEGY=fastest"], "fastest"),
    ],
)
def test_make_sale_refuses_what_it_cannot_do_and_starts_nothing(arguments, says):
    done = _make("sale", *arguments)
    assert done.returncode != 0
    assert says in done.stderr
    assert not Item.objects.filter(sku=arguments[0].split("=", 1)[1]).exists()


def test_make_admin_creates_a_staff_login():
    done = _make("admin", "ADMIN_USER=boss", DJANGO_SUPERUSER_PASSWORD="pw-for-tests-only")
    assert done.returncode == 0, done.stderr
    boss = User.objects.get(username="boss")
    assert boss.is_staff and boss.is_superuser and boss.check_password("pw-for-tests-only")
