"""The transactional tests' teardown: every row deleted, instead of Django's flush.

Django empties the database after each `transaction=True` test with the `flush` command: a
TRUNCATE of every table (a new file per table, 50-120 ms here), then the `post_migrate` signal,
which creates the content types and permissions the TRUNCATE removed (60 ms more). This deletes
the rows in one transaction instead (about 6 ms) and leaves those two tables alone, so their
rows keep their ids from test to test.

What TRUNCATE did implicitly is kept: it waited for every transaction still writing to the
tables (a server process of the test finishing a sale) and so removed their rows too. The
`LOCK TABLE` below waits for the same writers and holds off new ones until the commit. Every
foreign key is deferrable, so the tables are emptied in any order. If the lock is refused (a
deadlock with a writer), Django's own flush runs as before.
"""

from __future__ import annotations

from django.db import DatabaseError, connections, transaction
from django.test import TransactionTestCase

#: Rows that Django's flush removes only to create them again afterwards.
KEPT = frozenset({"django_content_type", "auth_permission"})

_django_teardown = TransactionTestCase._fixture_teardown
_tables: dict[str, list[str]] = {}


def _tables_of(alias: str) -> list[str]:
    if alias not in _tables:
        introspection = connections[alias].introspection
        names = introspection.django_table_names(only_existing=True, include_views=False)
        _tables[alias] = sorted(name for name in names if name not in KEPT)
    return _tables[alias]


def delete_every_row(test_case: TransactionTestCase) -> None:
    """`TransactionTestCase._fixture_teardown` for tests that keep every app (no
    `available_apps`, no serialized rollback): those are left to Django."""
    if test_case.available_apps is not None or test_case.serialized_rollback:
        _django_teardown(test_case)
        return
    for alias in test_case._databases_names(include_mirrors=False):
        connection = connections[alias]
        tables = [connection.ops.quote_name(name) for name in _tables_of(alias)]
        try:
            with transaction.atomic(using=alias), connection.cursor() as cursor:
                cursor.execute(f"LOCK TABLE {', '.join(tables)} IN SHARE ROW EXCLUSIVE MODE")
                cursor.execute("SET CONSTRAINTS ALL DEFERRED")
                for table in tables:
                    cursor.execute(f"DELETE FROM {table}")
        except DatabaseError:
            _django_teardown(test_case)
            return


def install() -> None:
    TransactionTestCase._fixture_teardown = delete_every_row  # type: ignore[method-assign]
