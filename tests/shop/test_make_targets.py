"""`make sale` and `make admin`: what a newcomer types beside `make serve`, run for real, with
and without a terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
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
        stdin=subprocess.DEVNULL,  # no terminal, as under CI or a script
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


def test_make_admin_without_a_password_or_a_terminal_says_what_to_do_and_makes_nothing():
    done = _make("admin", "ADMIN_USER=lonely")

    assert done.returncode != 0
    assert "no password for lonely, and no terminal to ask for one" in done.stderr
    assert "DJANGO_SUPERUSER_PASSWORD" in done.stderr
    assert not User.objects.filter(username="lonely").exists()


@pytest.mark.slow
def test_make_admin_again_says_the_login_exists_and_how_to_change_its_password():
    first = _make("admin", "ADMIN_USER=boss", DJANGO_SUPERUSER_PASSWORD="pw-for-tests-only")
    assert first.returncode == 0, first.stderr

    for password in ("another-pw-for-tests", None):  # with a password, and with none
        again = _make("admin", "ADMIN_USER=boss", DJANGO_SUPERUSER_PASSWORD=password or "")

        assert again.returncode == 0, again.stderr
        assert "boss already exists: nothing changed" in again.stdout
        assert 'make manage ARGS="changepassword boss"' in again.stdout
    assert User.objects.get(username="boss").check_password("pw-for-tests-only")


def _read_until(fd: int, text: str, *, timeout: float) -> str:
    """What the terminal showed, once it shows `text` (or the deadline passed)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        try:
            chunk = os.read(fd, 4096) if ready else b""
        except OSError:  # the other end closed
            break
        seen += chunk
    return seen.decode(errors="replace")


def test_make_admin_at_a_terminal_asks_for_the_password():
    # Given a terminal and no password in the environment
    terminal, its_end = pty.openpty()
    env = {**os.environ, **server_env()}
    env.pop("DJANGO_SUPERUSER_PASSWORD", None)
    make = subprocess.Popen(
        ["make", "--no-print-directory", "admin", "ADMIN_USER=typist"],
        cwd=ROOT,
        env=env,
        stdin=its_end,
        stdout=its_end,
        stderr=its_end,
    )
    os.close(its_end)
    try:
        # When the password is typed twice as asked
        for prompt in ("Password:", "Password (again):"):
            shown = _read_until(terminal, prompt, timeout=60)
            assert prompt in shown, shown
            os.write(terminal, b"a-long-typed-password\n")
        shown = _read_until(terminal, "can log in at /admin/", timeout=60)
        assert make.wait(timeout=60) == 0, shown
    finally:
        if make.poll() is None:
            make.kill()
        os.close(terminal)

    # Then the login exists, with that password
    typist = User.objects.get(username="typist")
    assert typist.is_staff and typist.check_password("a-long-typed-password")
