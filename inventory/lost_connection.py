"""A database connection lost around a sale statement: replaced before a statement is sent on
it, and, when lost while one ran, the database asked what that statement committed.

A statement whose answer was lost may have committed or not. The checkout never guesses: it
finds its orders by their public ids once the backend that wrote them is gone (`resolve`), and
answers as found (`NotWritten` when none is, `OutcomeUnknown` when the database does not
answer). Design: docs/design.md#the-sale-statement.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from .exceptions import NotWritten, OutcomeUnknown
from .models import Order

#: How long a checkout whose connection was lost mid-statement keeps asking the database whether
#: its sale committed (a restart, a failover), in seconds, before it answers that it cannot tell.
RESOLVE_SECONDS = 30.0


def checked_connection(database: Any = None) -> BaseDatabaseWrapper:
    """`database` (a Django database wrapper; the thread's default one unless given), connected,
    its connection replaced first if the server has closed it (a restart, a failover,
    `pg_terminate_backend`, an idle timeout), so that no statement is sent on a dead one.

    Django checks a reused connection once, at the start of a request or task
    (CONN_HEALTH_CHECKS); one terminated later (mid-request, between a batch's statements, in
    a thread that serves none) would go unchecked. So it is checked before each statement sent
    outside a transaction: a look at its socket, no round trip (`shop.postgresql`). Inside one
    it is never replaced (the transaction would be lost with it).
    """
    # once: each `connection.x` is a thread-local lookup
    wrapper: BaseDatabaseWrapper = database or connections[DEFAULT_DB_ALIAS]
    if wrapper.autocommit and not wrapper.in_atomic_block:
        wrapper.health_check_done = False  # type: ignore[attr-defined]  # (not in the stubs)
    wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    return wrapper


def connection_lost(database: Any) -> bool:
    """Whether the error just raised on `database` (a Django database wrapper) left its
    connection unusable (lost, closed by the server): then a statement sent on it may have
    committed or not, and only the database, asked again, knows."""
    raw = database.connection
    return raw is None or raw.closed or raw.broken


def resolve(public_ids: list[str], backend_pid: int | None) -> dict[str, int]:
    """The orders of a statement whose connection was lost, found once the backend that wrote
    them is gone: {public id: order id} of those that exist (NotWritten when none does).

    Asked on a new connection; the backend, if it still runs (the connection was cut, not the
    server), is terminated first and waited for, so that nothing it had in flight can commit
    after the answer. Raises OutcomeUnknown when the database does not answer within
    RESOLVE_SECONDS."""
    database = connections[DEFAULT_DB_ALIAS]
    give_up = time.monotonic() + RESOLVE_SECONDS
    pause = 0.05
    while True:
        database.close()
        try:
            with database.cursor() as cursor:
                if backend_pid is not None:
                    cursor.execute(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                        " WHERE pid = %s",
                        [backend_pid],
                    )
                cursor.execute(
                    f"SELECT public_id::text, id FROM {Order._meta.db_table}"
                    " WHERE public_id = ANY(%s::uuid[])",
                    [public_ids],
                )
                found = dict(cursor.fetchall())
            break
        except DatabaseError:
            if time.monotonic() >= give_up:
                raise OutcomeUnknown(public_ids[0]) from None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
    if not found:
        raise NotWritten(
            "the database connection was lost mid-statement, and the sale was not committed",
        )
    # PostgreSQL spells a uuid in lower case; a request may have spelt it otherwise.
    return {
        public_id: found[str(uuid.UUID(public_id))]
        for public_id in public_ids
        if str(uuid.UUID(public_id)) in found
    }
