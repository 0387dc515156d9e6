"""The database backend in place while DATABASE_URL is not set (shop.settings).

Commands that need no database run (`manage.py pitfall list`, `help`, the lab's scenarios that
use Redis alone); anything that reaches for the database raises ImproperlyConfigured saying how
to name one, which `manage.py` prints as one line. Django's dummy backend, with that message.
"""

from __future__ import annotations

from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.dummy import base

MESSAGE = (
    "this needs the database, and DATABASE_URL is not set: run it through make (`make manage "
    'ARGS="..."`, `make pitfall`, `make serve`: they start an embedded PostgreSQL), or '
    "through `python -m shop.devservices -- COMMAND`, or set "
    "DATABASE_URL=postgres://USER@HOST:5432/NAME"
)


def complain(*args: Any, **kwargs: Any) -> NoReturn:
    raise ImproperlyConfigured(MESSAGE)


class DatabaseOperations(base.DatabaseOperations):
    quote_name = complain


class DatabaseClient(base.DatabaseClient):
    runshell = complain


class DatabaseIntrospection(base.DatabaseIntrospection):
    get_table_list = complain
    get_table_description = complain
    get_relations = complain
    get_indexes = complain


class DatabaseWrapper(base.DatabaseWrapper):
    vendor = "none"
    display_name = "no database (DATABASE_URL is not set)"
    _cursor = complain
    ensure_connection = complain
    _commit = complain
    _savepoint_commit = complain
    _set_autocommit = complain
    client_class = DatabaseClient
    introspection_class = DatabaseIntrospection
    ops_class = DatabaseOperations
