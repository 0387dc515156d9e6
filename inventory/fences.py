"""Fencing tokens from the database, for locks held on several Redis masters at once
(`locking.QuorumLock`), whose fences no single master may hand out: a master that restarted
empty would hand out numbers it had handed out before."""

from __future__ import annotations

from django.db import connection, transaction

# max(last + 1, the database server's clock in microseconds): it grows with every grant of the
# name, and it is on the scale of the fences a single Redis hands out (its own clock in
# microseconds, `locking.scripts`), so switching a lock between the two keeps fences growing as
# long as the two clocks agree within the time since the last grant.
_NEXT_FENCE = """
INSERT INTO inventory_lockfence (name, fence)
VALUES (%s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
ON CONFLICT (name) DO UPDATE
SET fence = GREATEST(inventory_lockfence.fence + 1, EXCLUDED.fence)
RETURNING fence
"""


def next_fence(name: str) -> int:
    """The next fencing token of lock `name`, committed before it is returned (on its own
    connection's autocommit, or with the caller's transaction when there is one: a lock is taken
    before the sale's transaction opens)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_NEXT_FENCE, [name])
        return int(cursor.fetchone()[0])
