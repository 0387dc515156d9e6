"""Where load runs and benchmarks sell: a database, a Redis key prefix and a task queue of
their own, beside the shop's, so that their orders and items never reach the storefront or
keep the shop's sweeper busy.

- database `<the shop's>_loadrun` on the same PostgreSQL, created and migrated on first use;
- Redis keys under `<FLASHSALE_REDIS_PREFIX>-loadrun`, order tasks on `<queue>-loadrun`;
- only the SaleRun records, which the admin's compare page shows, go to the shop's database:
  `FLASHSALE_RUNS_DATABASE_URL` names it (a seam of the lab settings, `shop.lab_settings`, which
  a sandboxed process runs) and `RunsRouter` sends SaleRun there.

A process enters the sandbox by starting again with the sandbox's environment (`enter`), so
that everything it starts (the web server, the Celery worker, buyer processes) inherits it.
`drop` removes the sandbox (`manage.py sandbox drop`); the next run creates it again.
See docs/load-runs.md#where-it-sells.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, NoReturn
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import Model

from shop.nodatabase import base as nodatabase

#: Set (to "1") in a sandboxed process's environment.
MARK = "FLASHSALE_SANDBOX"
#: The settings a sandboxed process runs: the shop's, plus the seams the lab sets.
SETTINGS_MODULE = "shop.lab_settings"
SUFFIX = "_loadrun"
#: PostgreSQL's longest identifier.
NAME_LIMIT = 63
RUNS_ALIAS = "runs"


class SandboxError(Exception):
    """The sandbox database could not be prepared; the message says why."""


def active() -> bool:
    return os.environ.get(MARK) == "1"


def database_name(shop_name: str) -> str:
    return shop_name[: NAME_LIMIT - len(SUFFIX)] + SUFFIX


def environment(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a process in the sandbox of the shop `base` describes."""
    url = base.get("DATABASE_URL", "")
    if not url:
        raise SandboxError(nodatabase.MESSAGE)
    parts = urlsplit(url)
    shop_name = unquote(parts.path.lstrip("/"))
    if not parts.scheme or not shop_name:
        raise SandboxError(f"DATABASE_URL names no database to put a sandbox beside: {url!r}")
    sandbox_url = urlunsplit(parts._replace(path="/" + quote(database_name(shop_name))))
    return {
        **base,
        MARK: "1",
        "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
        "DATABASE_URL": sandbox_url,
        "FLASHSALE_RUNS_DATABASE_URL": url,
        "FLASHSALE_REDIS_PREFIX": settings.FLASHSALE_REDIS_PREFIX + "-loadrun",
        "FLASHSALE_TASK_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE + "-loadrun",
    }


def prepare(env: Mapping[str, str]) -> str:
    """Create the sandbox database if missing and apply the migrations; return its name."""
    name = unquote(urlsplit(env["DATABASE_URL"]).path.lstrip("/"))
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            if cursor.fetchone() is None:
                cursor.execute(f'CREATE DATABASE "{name}"')
    except DatabaseError as exc:
        if "already exists" not in str(exc):  # another run created it a moment ago
            raise SandboxError(f"cannot create the load-run database {name}: {exc}") from exc
    migrate = subprocess.run(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "migrate", "--noinput", "-v", "0"],
        env=dict(env),
        capture_output=True,
        text=True,
    )
    if migrate.returncode != 0:
        raise SandboxError(f"cannot migrate the load-run database {name}:\n{migrate.stderr}")
    return name


def enter(argv: Sequence[str]) -> NoReturn:
    """Run `python argv...` again in the sandbox, in place of this process."""
    env = environment(os.environ)
    name = prepare(env)
    with connection.cursor() as cursor:
        # Nothing prunes the sandbox: every run's orders stay until it is dropped.
        cursor.execute("SELECT pg_size_pretty(pg_database_size(%s))", [name])
        (size,) = cursor.fetchone()
    print(
        f"load-run sandbox: database {name} ({size}; `make clean-sandbox` drops it between "
        f"runs), Redis prefix {env['FLASHSALE_REDIS_PREFIX']}",
        file=sys.stderr,
        flush=True,
    )
    connection.close()
    os.execve(sys.executable, [sys.executable, *argv], env)


class Dropped(NamedTuple):
    """What `drop` dropped."""

    database: str
    #: Whether the database was there to drop.
    existed: bool
    #: The sandbox's Redis key prefix, and how many keys under it were deleted.
    prefix: str
    keys: int


def drop(env: Mapping[str, str]) -> Dropped:
    """Drop the sandbox of the shop `env` describes: its database, then its Redis keys.

    Raises SandboxError, having dropped nothing, while anything is connected to the database (a
    load run or a bench selling in it): PostgreSQL waits up to 5 s for its sessions to end, then
    refuses. Meant for between runs: a bench is without a connection for a moment between
    rounds. The keys go with the database even when it is gone already: a sale of a database
    created again starts its ids at 1, and would meet its namesake's keys (claims, give-back
    markers).
    """
    from inventory.redis_client import get_redis_client

    sandbox = environment(env)
    name = unquote(urlsplit(sandbox["DATABASE_URL"]).path.lstrip("/"))
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
        existed = cursor.fetchone() is not None
        try:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        except DatabaseError as exc:
            if getattr(exc.__cause__, "sqlstate", None) == OBJECT_IN_USE:
                # PostgreSQL's detail says how many: "There are 2 other sessions using ...".
                detail = getattr(getattr(exc.__cause__, "diag", None), "message_detail", "")
                who = f": {detail.rstrip('.')}" if detail else ""
                raise SandboxError(
                    f"the load-run database {name} is in use (a load run or a bench selling in "
                    f"it, or another connection{who}): nothing was dropped"
                ) from None
            raise SandboxError(f"cannot drop the load-run database {name}: {exc}") from exc
    client = get_redis_client()
    prefix = sandbox["FLASHSALE_REDIS_PREFIX"]
    deleted = delete_prefix(client, prefix + ":")
    return Dropped(name, existed, prefix, deleted)


#: SQLSTATE object_in_use: DROP DATABASE while other sessions are connected to it.
OBJECT_IN_USE = "55006"


def delete_prefix(client: Any, prefix: str) -> int:
    """Delete every key of `client` whose name starts with `prefix`, a thousand at a time;
    returns how many were deleted."""
    pattern = "".join("\\" + char if char in "*?[]\\" else char for char in prefix) + "*"
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) == 1000:
            deleted += client.delete(*batch)
            batch.clear()
    if batch:
        deleted += client.delete(*batch)
    return deleted


class RunsRouter:
    """In a sandboxed process, SaleRun (the compare page's records) lives in the shop's
    database, alias `runs`; everything else in the sandbox's."""

    def db_for_read(self, model: type[Model], **hints: object) -> str | None:
        return RUNS_ALIAS if model._meta.label == "loadtest.SaleRun" else None

    db_for_write = db_for_read
