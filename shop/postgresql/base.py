"""Django's PostgreSQL backend with a health check that costs no round trip.

With CONN_HEALTH_CHECKS, Django checks a reused connection at the start of every request by
sending `SELECT 1`: one more round trip per checkout, for both the web process and PostgreSQL.
A connection the server closed (a restart, a failover, `idle_session_timeout`,
`pg_terminate_backend`) has already told the client so: PostgreSQL sends a FATAL message and
closes the socket, which is then readable. An idle connection's socket is not. So only a
readable socket (or a connection no longer OK) costs the `SELECT 1` that decides.
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg import pq


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        connection = self.connection
        if connection is None or connection.closed:
            return False
        if connection.pgconn.status != pq.ConnStatus.OK:
            return False
        try:
            readable, _, _ = select.select([connection.pgconn.socket], [], [], 0)
        except (OSError, ValueError):
            return False
        if readable:
            # Something arrived unasked: the server saying goodbye, or a notification.
            return super().is_usable()
        return True
