"""inventory.fastpath.DirectStatement: a prepared statement run through libpq as psycopg exposes
it answers and fails exactly as the prepared cursor does, prepares once per connection, and is
the prepared cursor itself wherever that one does more than run the statement.

Against the test database: the errors are PostgreSQL's own, the connections real ones.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta, timezone

import pytest
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from inventory.fastpath import DirectStatement, prepared_cursor
from inventory.lost_connection import checked_connection, connection_lost

pytestmark = pytest.mark.django_db(transaction=True)

#: One statement with a parameter of each kind it spells, read back as PostgreSQL typed it.
EVERY_KIND = DirectStatement(
    "SELECT %(number)s::bigint, %(text)s::text, %(yes)s::boolean, %(no)s::boolean,"
    " %(array)s::bigint[], %(at)s::timestamptz, %(document)s::jsonb, %(nothing)s::integer,"
    " %(number)s::bigint + 1, '100%%'"
)
VALUES = {
    "number": 2**40,
    "text": 'l\'été "quoted" {braces}, commas',
    "yes": True,
    "no": False,
    "array": [3, None, -7],
    "at": datetime(2026, 12, 3, 22, 30, 1, 123456, tzinfo=timezone(timedelta(hours=-5))),
    "document": '{"rows": {"3": 1}, "name": "ann"}',
    "nothing": None,
}

#: The prepared statements of this session that were prepared by protocol, not by PREPARE.
PREPARED = (
    "SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements WHERE NOT from_sql"
)


def _rows(statement: DirectStatement, params: dict) -> list[tuple]:
    return statement.rows(params, checked_connection())


def test_it_answers_what_the_prepared_cursor_answers():
    with prepared_cursor() as cursor:
        cursor.execute(EVERY_KIND.sql, VALUES)
        expected = cursor.fetchall()

    assert _rows(EVERY_KIND, VALUES) == expected
    # (what each came back as, in case the cursor's answer were wrong the same way)
    (row,) = expected
    assert row[:5] == (2**40, VALUES["text"], True, False, [3, None, -7])
    assert row[5] == VALUES["at"] and row[5].tzinfo is not None
    assert row[6] == '{"name": "ann", "rows": {"3": 1}}'  # Django reads JSON itself
    assert row[7:] == (None, 2**40 + 1, "100%")


def test_it_prepares_once_per_connection_and_again_on_a_new_one():
    statement = DirectStatement("SELECT %(n)s::integer * 2 AS twice")

    assert [_rows(statement, {"n": n}) for n in range(3)] == [[(0,)], [(2,)], [(4,)]]
    with connection.cursor() as cursor:
        cursor.execute(PREPARED)
        assert [row for row in cursor.fetchall() if "twice" in row[0]] == [
            ("SELECT $1::integer * 2 AS twice", 3)
        ]

    connection.close()  # a connection replaced: its statements went with it

    assert _rows(statement, {"n": 5}) == [(10,)]
    with connection.cursor() as cursor:
        cursor.execute(PREPARED)
        assert [row[1] for row in cursor.fetchall() if "twice" in row[0]] == [1]


def test_a_refused_statement_raises_what_a_cursor_raises_and_the_connection_goes_on():
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE direct_keys (key text PRIMARY KEY)")
    statement = DirectStatement("INSERT INTO direct_keys (key) VALUES (%(sku)s) RETURNING key")
    assert _rows(statement, {"sku": "direct-twice"}) == [("direct-twice",)]

    with pytest.raises(IntegrityError) as raised:
        _rows(statement, {"sku": "direct-twice"})

    # Django's error, psycopg's as its cause: what callers read the SQLSTATE from
    assert raised.value.__cause__.sqlstate == "23505"
    assert "direct-twice" in str(raised.value)
    assert _rows(statement, {"sku": "direct-again"}) == [("direct-again",)]


def test_a_value_it_cannot_spell_is_refused_before_anything_is_sent():
    statement = DirectStatement("INSERT INTO inventory_sale (item_id) VALUES (%(item)s)")

    for value in (1.5, datetime(2026, 12, 3), ["a", "b"], b"raw", {"a": 1}):
        with pytest.raises(TypeError, match="cannot spell"):
            _rows(statement, {"item": value})


def test_positional_placeholders_are_refused():
    with pytest.raises(ValueError, match="names its parameters"):
        DirectStatement("SELECT %s::integer")


def test_a_connection_lost_in_the_statement_raises_and_is_seen_lost():
    # Given a statement in flight whose backend is terminated (the database restarted, the
    # connection cut) while it runs
    statement = DirectStatement("SELECT pg_sleep(%(seconds)s::float8)")
    database = checked_connection()
    backend = database.connection.info.backend_pid
    answered = threading.Event()

    def terminate() -> None:
        killer = connections.create_connection("default")
        try:
            with killer.cursor() as cursor:
                while not answered.is_set():  # until the statement runs on that backend
                    cursor.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE pid = %s AND state = 'active'",
                        [backend],
                    )
                    if cursor.fetchone():
                        return
        finally:
            killer.close()

    thread = threading.Thread(target=terminate)
    thread.start()
    try:
        with pytest.raises(DatabaseError):
            statement.rows({"seconds": 30}, database)
    finally:
        answered.set()
        thread.join()

    # Then its caller can tell: the answer may have been lost after a commit
    assert connection_lost(database)
    connection.close()
    assert _rows(DirectStatement("SELECT %(n)s::integer"), {"n": 1}) == [(1,)]


def test_logged_queries_see_the_statement_with_its_values():
    statement = DirectStatement("SELECT %(who)s::text AS logged_direct")

    with CaptureQueriesContext(connection) as captured:
        assert _rows(statement, {"who": "ann-direct"}) == [("ann-direct",)]

    assert [query["sql"] for query in captured] == ["SELECT 'ann-direct'::text AS logged_direct"]


def test_an_execute_wrapper_sees_the_statement():
    statement = DirectStatement("SELECT %(n)s::integer AS wrapped_direct")
    seen = []

    def wrapper(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert _rows(statement, {"n": 7}) == [(7,)]

    assert seen == [(statement.sql, {"n": 7})]


def test_without_prepared_statements_it_prepares_nothing():
    # What DJANGO_DB_PREPARED_STATEMENTS=false leaves the connection (for a pooler)
    statement = DirectStatement("SELECT %(n)s::integer AS unprepared_direct")
    database = checked_connection()
    database.connection.prepare_threshold = None
    try:
        assert _rows(statement, {"n": 3}) == [(3,)]
        with connection.cursor() as cursor:
            cursor.execute(PREPARED)
            assert [row for row in cursor.fetchall() if "unprepared_direct" in row[0]] == []
    finally:
        connection.close()


def test_an_aware_datetime_keeps_its_moment_whatever_the_sessions_time_zone():
    statement = DirectStatement("SELECT %(at)s::timestamptz = %(utc)s::timestamptz")
    at = datetime(2026, 12, 3, 23, 59, 59, 999999, tzinfo=timezone(timedelta(hours=9)))
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'America/Los_Angeles'")
    try:
        assert _rows(statement, {"at": at, "utc": at.astimezone(UTC)}) == [(True,)]
    finally:
        connection.close()


def test_other_threads_run_while_a_statement_waits():
    # Given a statement that waits for a lock another session holds, with a server-side bound
    # (lock_timeout): held against the other threads of its process, the interpreter would
    # leave this thread no way to let go before that bound, and the statement would fail
    holder = connections.create_connection("default")
    holder.ensure_connection()
    holder.connection.execute("SELECT pg_advisory_lock(31, 1)")
    statement = DirectStatement(
        "SELECT set_config('lock_timeout', %(bound)s::text, false),"
        " pg_advisory_lock(31, 1) IS NOT NULL AS locked"
    )
    answers: list[object] = []
    database = checked_connection()

    def waits() -> None:
        try:
            answers.append(statement.rows({"bound": "5000"}, database))
        except DatabaseError as error:
            answers.append(error)

    # (the thread uses this thread's connection, as a batch's leader uses its own)
    database.inc_thread_sharing()
    thread = threading.Thread(target=waits)
    thread.start()
    try:
        # When this thread sees it waiting and lets go
        watch = holder.connection.cursor()
        while not watch.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            [database.connection.info.backend_pid],
        ).fetchone():
            assert thread.is_alive(), answers
        holder.connection.execute("SELECT pg_advisory_unlock(31, 1)")
    finally:
        thread.join()
        database.dec_thread_sharing()
        holder.close()

    # Then its statement got the lock
    assert answers == [[("5s", True)]]
    connection.close()


def test_it_goes_on_after_a_rollback_deallocated_every_statement_of_its_connection():
    # Given a connection whose statements psycopg has also prepared (the item read, say), then
    # a Django atomic block that failed: psycopg deallocates every prepared statement of the
    # connection after a rollback, this one's too
    statement = DirectStatement("SELECT %(n)s::integer AS after_rollback")
    assert _rows(statement, {"n": 1}) == [(1,)]
    with prepared_cursor() as cursor:
        cursor.execute("SELECT %s::integer AS prepared_by_psycopg", [2])
    with pytest.raises(RuntimeError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        raise RuntimeError("the block fails")
    with connection.cursor() as cursor:
        cursor.execute(PREPARED)
        assert not [row for row in cursor.fetchall() if "after_rollback" in row[0]]

    # Then the next run prepares it again and answers
    assert _rows(statement, {"n": 3}) == [(3,)]


def test_inside_a_transaction_it_is_the_prepared_cursor():
    # (a failed statement there would abort the caller's transaction: nothing could be
    # prepared and sent again)
    statement = DirectStatement("SELECT %(n)s::integer AS inside_direct")
    with transaction.atomic():
        assert _rows(statement, {"n": 4}) == [(4,)]
        with connection.cursor() as cursor:
            cursor.execute(PREPARED)
            assert [row[0] for row in cursor.fetchall() if "inside_direct" in row[0]] == [
                "SELECT $1::integer AS inside_direct"
            ]
    # prepared by psycopg, under its own name, not this statement's
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name FROM pg_prepared_statements WHERE statement LIKE '%inside_direct'"
        )
        names = [name for (name,) in cursor.fetchall()]
    assert names and statement._name.decode() not in names
