"""Where the checkout leaves Django's usual road to spend less CPU: every trick of the hot path
that a Django reader would not expect, each with what it replaces and the figure that pays for
it. None changes an answer: each gives what the ordinary way would, only cheaper.

- `committed_order`: an Order built without `Model.__init__`;
- `prepared_cursor`: statements prepared once per connection (server-side binding);
- `DirectStatement`: a prepared statement run through libpq as psycopg exposes it;
- `built_once_per_shape`: the sale statement's text remembered, not built for every sale;
- `compact_json`: orjson instead of the standard library's encoder;
- `read_checkout_item`, `read_item_with_sale`: the two reads every checkout or item page
  makes, hand-written and built with `Model.from_db` instead of the ORM's querysets.

One lives elsewhere, with its figure: the database backend's health check that looks at the
socket instead of sending `SELECT 1` (`shop/postgresql/base.py`): Django loads a backend while
it builds the first model, before this module's models can be imported.
"""

from __future__ import annotations

import hashlib
import re
import time
import weakref
from collections.abc import Callable, Hashable
from datetime import datetime
from functools import cache
from typing import Any, TypeVar

import orjson
import psycopg
import psycopg.adapt
import psycopg.errors
import psycopg.pq
from django.db import DEFAULT_DB_ALIAS, connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from .lost_connection import checked_connection
from .models import Item, Order, Sale, StockShard

# -- an Order without Model.__init__ ---------------------------------------------------------

#: Order's columns, in the order `Order.from_db` takes them.
_ORDER_FIELDS = [model_field.attname for model_field in Order._meta.concrete_fields]
#: Each column None: the value of those a sale leaves unset.
_NO_ORDER_FIELDS = dict.fromkeys(_ORDER_FIELDS)


def committed_order(fields: dict[str, Any], item: Item) -> Order:
    """The `Order` of a row a sale statement has just committed with these fields, built
    without reading it back: a checkout builds one per sale.

    As the ORM builds a row it read (`Model.from_db`: an instance that is not `adding`, of the
    default database), less its per-field work. Nothing is lost while nobody listens to
    `pre_init`/`post_init` (the signals `__init__` sends); while anyone does, the order is
    built through `from_db` after all.
    """
    values = {**_NO_ORDER_FIELDS, **fields, "item_id": item.pk}
    if pre_init.receivers or post_init.receivers:
        order = Order.from_db(DEFAULT_DB_ALIAS, _ORDER_FIELDS, [values[n] for n in _ORDER_FIELDS])
    else:
        # Pays for: `Model.__init__` sets each of the fourteen fields through its descriptor,
        # which cost a fifth of a `lua` checkout's CPU in the web process (2026-11-28, commit
        # db77023; the profile's command was not recorded).
        order = Order.__new__(Order)
        order.__dict__.update(values)
        state = order._state = ModelState()
        state.adding = False
        state.db = DEFAULT_DB_ALIAS
    order._state.fields_cache["item"] = item
    return order


# -- statements prepared once per connection -------------------------------------------------


class _PreparingCursor(psycopg.Cursor):
    """A server-side binding cursor whose statements are prepared on their first execution."""

    def execute(self, query, params=None, *, prepare=True, binary=None):
        return super().execute(query, params, prepare=prepare, binary=binary)


def prepared_cursor(database: Any = None) -> Any:
    """A Django cursor (error wrapping, debug log, execute wrappers) that prepares statements.

    For the statements every checkout runs (reading the item, the sale statement): prepared
    once per connection, PostgreSQL skips parsing and planning them. Django keeps prepared
    statements off by default for the sake of poolers in transaction mode: with
    `DJANGO_DB_PREPARED_STATEMENTS=false` the connection has no `prepare_threshold` and psycopg
    ignores `prepare=True`, so the same code runs unprepared. On `database` (a Django database
    wrapper) when given, else the thread's default connection, checked first
    (`lost_connection.checked_connection`).
    """
    # Pays for: parsing and planning were 40% of PostgreSQL's CPU per sale, 0.30 ms down to
    # 0.17 ms (2026-11-22, commit 671839c).
    return _preparing_cursor(checked_connection(database))


def _preparing_cursor(wrapper: BaseDatabaseWrapper) -> Any:
    """`prepared_cursor` on `wrapper` (a connected Django database wrapper) as it is."""
    raw = _PreparingCursor(wrapper.connection)
    if wrapper.queries_logged:
        return _PreparedDebugWrapper(raw, wrapper)
    # make_cursor wraps any DB-API cursor (its stub names Django's own cursor type).
    return wrapper.make_cursor(raw)  # type: ignore[arg-type]


class _PreparedDebugWrapper(CursorDebugWrapper):
    """Django's debug cursor, logging the statement with its parameters filled in.

    Django reads the text of what ran back from the cursor, which a server-binding cursor does
    not keep: it would log None (in `connection.queries`, the debug toolbar, the SQL log).
    """

    def execute(self, sql, params=None):
        with self.debug_sql(self.db.ops.compose_sql(sql, params), params):
            return CursorWrapper.execute(self, sql, params)


# -- a prepared statement sent straight through libpq ----------------------------------------


class DirectStatement:
    """A statement prepared once per connection and run through the libpq wrapper psycopg
    exposes (`Connection.pgconn`): its parameters spelled as text here, its rows read by
    psycopg's own loaders. What `prepared_cursor`'s `execute` and `fetchall` give, less
    psycopg's work around them: adapting each parameter (arrays element by element), and the
    generators that send and wait for a statement. libpq waits for the answer with the
    interpreter released, as psycopg does.

    `sql` names its parameters as psycopg does (`%(name)s`); `rows` takes them by name: None,
    bool, int, str, an aware datetime, or a list of int and None (an array); anything else is
    a TypeError, before anything is sent.

    It runs outside a transaction only, where a statement the server no longer knows (psycopg
    deallocates every statement of a connection after a rollback) is prepared and sent again
    with nothing lost. It is the ordinary prepared cursor inside a transaction, and wherever
    that one does more than run the statement: when queries are logged (`connection.queries`,
    the debug toolbar), when an execute wrapper is installed (`connection.execute_wrapper`:
    tracing, instrumentation), or when prepared statements are off
    (`DJANGO_DB_PREPARED_STATEMENTS=false`, for a pooler).
    """

    # Pays for: the batch statement of 4 sales cost its thread 0.46-0.60 ms of CPU through
    # `prepared_cursor`, 0.18-0.24 ms this way; without HTTP, `lua, batched` sold 1.14x as much
    # (medians of 3 runs each) on 18% less CPU a unit in its processes (2026-12-03,
    # docs/decisions/0031-the-batch-statement-sent-through-libpq.md).

    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.names: list[str] = []
        self._text = _NAMED.sub(self._number, sql).replace("%%", "%").encode()
        if _POSITIONAL.search(sql.replace("%%", "")):
            raise ValueError("a DirectStatement names its parameters: %(name)s, not %s")
        self._name = b"flashsale_" + hashlib.sha1(self._text).hexdigest()[:16].encode()

    def _number(self, match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in self.names:
            self.names.append(name)
        return f"${self.names.index(name) + 1}"

    def rows(self, params: dict[str, Any], database: BaseDatabaseWrapper) -> list[tuple[Any, ...]]:
        """Run the statement with `params` on `database` (a Django database wrapper, connected:
        the caller checks it first, `lost_connection.checked_connection`, and reads what it
        needs of the connection before the statement is sent) and return its rows. Its errors
        are Django's, their causes psycopg's, as a cursor raises them."""
        raw = database.connection
        if (
            database.in_atomic_block
            or database.queries_logged
            or database.execute_wrappers
            or raw.prepare_threshold is None
        ):
            with _preparing_cursor(database) as cursor:
                cursor.execute(self.sql, params)
                return cursor.fetchall()
        values = [_spelt(params[name]) for name in self.names]
        with database.wrap_database_errors:
            pgconn = raw.pgconn
            prepared = _prepared.setdefault(raw, set())
            for attempt in range(2):
                if self._name not in prepared:
                    _check(pgconn.prepare(self._name, self._text), raw)
                    prepared.add(self._name)
                result = pgconn.exec_prepared(self._name, values)
                if attempt or not _deallocated(result):
                    break
                # psycopg deallocates every statement of its connection after a rollback (a
                # Django atomic block that failed): nothing ran, prepare it again, once.
                prepared.discard(self._name)
            _check(result, raw)
            loader = psycopg.adapt.Transformer(raw)
            loader.set_pgresult(result)
            return loader.load_rows(0, result.ntuples, tuple)


_NAMED = re.compile(r"%\((\w+)\)s")
_POSITIONAL = re.compile(r"%s")
#: The statements each connection has prepared, by connection (held weakly: a connection
#: replaced takes its own with it).
_prepared: weakref.WeakKeyDictionary[psycopg.Connection, set[bytes]] = weakref.WeakKeyDictionary()
_ANSWERED = (psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK)


def _check(result: psycopg.pq.abc.PGresult, raw: psycopg.Connection) -> psycopg.pq.abc.PGresult:
    """`result`, or the error psycopg would raise for it."""
    if result.status not in _ANSWERED:
        raise psycopg.errors.error_from_result(result, encoding=raw.info.encoding)
    return result


def _deallocated(result: psycopg.pq.abc.PGresult) -> bool:
    """Whether the server answered that it knows no such prepared statement."""
    return result.status == psycopg.pq.ExecStatus.FATAL_ERROR and (
        result.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"26000"
    )


def _spelt(value: object) -> bytes | None:
    """`value` as PostgreSQL reads it in text (None: NULL)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.isoformat().encode()
    if isinstance(value, list) and all(v is None or type(v) is int for v in value):
        return ("{" + ",".join("NULL" if v is None else str(v) for v in value) + "}").encode()
    raise TypeError(f"a DirectStatement cannot spell {value!r} ({type(value).__name__})")


# -- the sale statement's text, built once per shape ----------------------------------------

AnyShape = TypeVar("AnyShape", bound=Hashable)


def built_once_per_shape(build: Callable[[AnyShape], str]) -> Callable[[AnyShape], str]:
    """`build`, remembered for each shape it is given (`functools.cache`): for the sale
    statement's text (`sale_sql.sale_sql`), which is the same for every sale of one shape."""
    # Pays for: building the text costs 2-13 us a sale, the remembered one 0.2-0.3 us
    # (2026-12-01, `timeit` of an item row's and a stock row's shapes, 50,000 calls each).
    return cache(build)


# -- JSON by orjson --------------------------------------------------------------------------

#: How the batch statement's JSON is written: without spaces, keys that are not strings written
#: as strings (as `json.dumps` does).
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def compact_json(value: Any) -> str:
    """`json.dumps(value, separators=(",", ":"))`, by orjson."""
    # Pays for: the standard library's encoder cost 3.4 us a buyer's request against orjson's
    # 0.4 (2026-11-28, commit 459c42f).
    return orjson.dumps(value, option=JSON_OPTIONS).decode()


# -- the reads every checkout and item page make ---------------------------------------------

#: The item's columns a checkout reads.
CHECKOUT_COLUMNS = (
    "id",
    "sku",
    "name",
    "price",
    "stock",
    "version",
    "strategy",
    "per_buyer_limit",
    "shard_count",
    "current_sale_id",
)


def read_checkout_item(sku: str) -> tuple[Item, tuple[datetime, float] | None] | None:
    """The item sold as sku (its CHECKOUT_COLUMNS) and its sale's opening: when it opens, and
    the moment of this host's `time.monotonic()` at which the database's clock reaches that
    (None without a sale); None when there is no such item.

    What `Item.objects.only(*CHECKOUT_COLUMNS).get(sku=sku)` and a read of its sale's
    `opens_at` against `statement_timestamp()` give, in one hand-written, prepared query.
    """
    # Pays for: the ORM's query building, run for every checkout (unmeasured for this query;
    # the item page's like read below was measured).
    columns = ", ".join(f"i.{column}" for column in CHECKOUT_COLUMNS)
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT {columns}, s.opens_at,"
            " EXTRACT(EPOCH FROM s.opens_at - statement_timestamp())::float8"
            f" FROM {Item._meta.db_table} i"
            f" LEFT JOIN {Sale._meta.db_table} s ON s.id = i.current_sale_id WHERE i.sku = %s",
            [sku],
        )
        row = cursor.fetchone()
        read_at = time.monotonic()
    if row is None:
        return None
    item = Item.from_db(connection.alias, CHECKOUT_COLUMNS, row[:-2])
    opens_at, seconds = row[-2:]
    return item, (None if opens_at is None else (opens_at, read_at + seconds))


_ITEM_FIELDS = [field.attname for field in Item._meta.concrete_fields]
_ITEM_COLUMNS = [field.column for field in Item._meta.concrete_fields]
_SALE_FIELDS = [field.attname for field in Sale._meta.concrete_fields]
_SALE_COLUMNS = [field.column for field in Sale._meta.concrete_fields]
# The units left as `ItemQuerySet.with_units_left` derives them.
_ITEM_QUERY = (
    "SELECT "
    + ", ".join([f"i.{c}" for c in _ITEM_COLUMNS] + [f"s.{c}" for c in _SALE_COLUMNS])
    + ", CASE WHEN i.shard_count = 0 THEN i.stock ELSE COALESCE("
    f"(SELECT SUM(r.stock) FROM {StockShard._meta.db_table} r"
    " WHERE r.sale_id = i.current_sale_id), 0) END"
    f" FROM {Item._meta.db_table} i LEFT JOIN {Sale._meta.db_table} s"
    " ON s.id = i.current_sale_id WHERE i.sku = %s"
)


def read_item_with_sale(sku: str) -> Item | None:
    """What `Item.objects.with_units_left().select_related("current_sale").get(sku=sku)`
    returns (None where it raises DoesNotExist), in one hand-written, prepared query."""
    # Pays for: every item page and `GET /api/items/<sku>` (a crowd's other request) runs it;
    # 0.2 ms of CPU against the ORM's 2.1 ms (2026-11-23, commit f08e2c7).
    with prepared_cursor() as cursor:
        cursor.execute(_ITEM_QUERY, [sku])
        row = cursor.fetchone()
    if row is None:
        return None
    item_width, sale_width = len(_ITEM_COLUMNS), len(_SALE_COLUMNS)
    item = Item.from_db(connection.alias, _ITEM_FIELDS, row[:item_width])
    item.__dict__["derived_units_left"] = row[-1]  # as the annotation sets it
    sale_row = row[item_width : item_width + sale_width]
    item._state.fields_cache["current_sale"] = (
        Sale.from_db(connection.alias, _SALE_FIELDS, sale_row) if sale_row[0] is not None else None
    )
    return item
