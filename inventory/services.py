"""Services: the writes. Views, commands and tasks parse input, call one of these, render."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import F

from . import deadline, keys, metrics, row_locks, stock
from .exceptions import (
    Busy,
    CheckoutError,
    InvalidRequest,
    LimitReached,
    NotOnSale,
    NotStarted,
    OutcomeUnknown,
    UnknownSku,
)
from .fastpath import read_checkout_item
from .models import Item, Order, Sale, StockShard
from .orders import order_placed
from .redis_client import REDIS_DOWN_ERRORS, get_redis_client
from .sale_statement import SaleRecorder
from .sale_values import RanPastDeadline, RowLockTimeout, SaleRestarted
from .selectors import database_now, forget_item_page
from .stock import split_stock
from .strategies import get_strategy, strategy_names

logger = logging.getLogger(__name__)

#: The strategy of the item this checkout reached (its metrics' label); the caller sets it
#: before each checkout.
checkout_strategy: ContextVar[str] = ContextVar("checkout_strategy", default="none")


@dataclass
class CountedCheckout:
    """A checkout being answered (`counted_checkout`): its outcome, `accepted` or the error's
    code (`inventory.metrics.CheckoutOutcome`), `error` until its entry point says otherwise."""

    outcome: str = metrics.CheckoutOutcome.ERROR


@contextmanager
def counted_checkout() -> Iterator[CountedCheckout]:
    """Count one checkout, from whichever entry point (the API, the storefront's form), once:
    in `flashsale_checkouts_total` by its item's strategy (`checkout_strategy`, `none` for no
    item) and the outcome the entry point sets, timed from here to the block's end. One that
    raises is counted `error`."""
    checkout_strategy.set(metrics.NO_STRATEGY)
    started = time.perf_counter()
    checkout = CountedCheckout()
    try:
        yield checkout
    finally:
        seconds = time.perf_counter() - started
        metrics.checkout_answered(checkout_strategy.get(), checkout.outcome, seconds)


ALLOWANCE_LIMIT_CONSTRAINT = "allowance_within_limit"
#: What a database that is down or restarting raises (and a connection it dropped): a checkout
#: that meets one has sold nothing, and is answered `503 busy`.
DATABASE_DOWN_ERRORS = (OperationalError, InterfaceError)


@dataclass(frozen=True)
class CheckoutResult:
    order: Order
    #: False when an earlier checkout with the same idempotency key is being replayed.
    created: bool


def place_order(
    *, sku: str, qty: int, buyer: str, idempotency_key: str | None = None
) -> CheckoutResult:
    """Sell qty units of sku to buyer through the item's strategy; the order is committed on return.

    Raises UnknownSku, NotOnSale, SoldOut, LimitReached, Busy or InvalidRequest (an idempotency
    key reused for a different checkout). Retrying with the same idempotency key returns the
    same order, even when the retries race each other.

    The key is not looked up first: the sale statement stores it under a unique constraint, so
    a retry of an accepted checkout either collides with the stored key (nothing is written)
    or is refused (sold out, limit reached, busy) before it gets that far. Only then is the
    earlier order read, so a first checkout with a key costs what one without does.
    """
    with deadline.checkout_deadline():
        try:
            return _place(sku=sku, qty=qty, buyer=buyer, idempotency_key=idempotency_key)
        except DATABASE_DOWN_ERRORS as exc:
            # Nothing was sold: a sale statement whose connection was lost has been looked up
            # again before this (`lost_connection.resolve`), and one the database rolled
            # back (a deadlock, a serialization failure: SQLSTATE class 40) wrote nothing.
            sqlstate = getattr(exc.__cause__, "sqlstate", None) or ""
            what = "rolled the sale back" if sqlstate.startswith("40") else "is not answering"
            raise Busy(
                f"{sku}: the database {what} ({exc.__class__.__name__}); nothing was sold",
            ) from None


def _place(*, sku: str, qty: int, buyer: str, idempotency_key: str | None) -> CheckoutResult:
    # Inside a caller's transaction a savepoint keeps it usable after a refused statement.
    inside = connections[DEFAULT_DB_ALIAS].in_atomic_block
    try:
        with transaction.atomic() if inside else nullcontext():
            order = _sell(sku=sku, qty=qty, buyer=buyer, idempotency_key=idempotency_key)
    except OutcomeUnknown:
        # The database did not answer whether the sale committed: it would not answer a
        # look-up by the key either, and a `503 busy` here would invite a retry.
        raise
    except (CheckoutError, IntegrityError):
        replay = _replay(idempotency_key, sku=sku, qty=qty, buyer=buyer)
        if replay is None:
            raise
        return CheckoutResult(order=replay, created=False)
    if inside:
        transaction.on_commit(lambda: order_placed(order.pk))
    else:
        order_placed(order.pk)  # the order row is committed by now
    return CheckoutResult(order=order, created=True)


def _sell(*, sku: str, qty: int, buyer: str, idempotency_key: str | None) -> Order:
    try:
        return _sell_once(
            sku=sku, qty=qty, buyer=buyer, idempotency_key=idempotency_key, fresh=False
        )
    except SaleRestarted:
        # The item was read (or remembered) before its sale was restarted: read it again.
        forget_item(sku)
    try:
        return _sell_once(
            sku=sku, qty=qty, buyer=buyer, idempotency_key=idempotency_key, fresh=True
        )
    except SaleRestarted:
        raise Busy(
            f"{sku}: its sale was restarted during the checkout",
        ) from None


def _sell_once(
    *, sku: str, qty: int, buyer: str, idempotency_key: str | None, fresh: bool
) -> Order:
    found = checkout_item(sku) if fresh else _remembered_item(sku)
    if found is None:
        raise UnknownSku(sku)
    item, opening = found
    checkout_strategy.set(item.strategy)
    if item.current_sale_id is None or opening is None:
        raise NotOnSale(sku)
    if opening.opens_after > time.monotonic():
        raise NotStarted(sku, opening.opens_at)
    limit = item.per_buyer_limit
    if limit is not None and qty > limit:
        raise LimitReached(sku=sku, limit=limit)

    record = SaleRecorder(
        item=item, qty=qty, buyer=buyer, idempotency_key=idempotency_key, limit=limit
    )
    try:
        return get_strategy(item.strategy).take(item=item, qty=qty, record=record)
    except RanPastDeadline:
        raise deadline.passed(sku) from None
    except RowLockTimeout:
        raise Busy(
            f"{sku}: its stock rows stayed locked by another transaction for "
            f"{row_locks.ROW_LOCK_TIMEOUT_MS} ms",
        ) from None
    except IntegrityError as exc:
        if _violated_constraint(exc) == ALLOWANCE_LIMIT_CONSTRAINT:
            raise LimitReached(sku=sku, limit=limit or 0) from None
        raise


@dataclass(frozen=True)
class Opening:
    """When an item's sale opens: `opens_at`, and the moment of this host's monotonic clock at
    which the database's clock reaches it (no host's own clock decides, so every web host
    opens the sale together, whatever their clocks say)."""

    opens_at: datetime
    opens_after: float


#: How long a checkout may use an item read by an earlier one (ms), for the strategies that
#: allow it: a second saves a crowd's checkouts their item read, and a sale restarted within
#: it is noticed by the write all the same (SaleRestarted).
ITEM_MEMORY_MS = 1000
#: sku -> (monotonic expiry, item, its sale's opening): items whose strategy may sell from an
#: item read a moment ago (`StockStrategy.item_may_be_remembered`).
_remembered: dict[str, tuple[float, Item, Opening | None]] = {}


def _remembered_item(sku: str) -> tuple[Item, Opening | None] | None:
    """checkout_item(sku), or the same read made less than ITEM_MEMORY_MS ago.

    Only for an item whose strategy decides from state kept per sale (Redis counters of the
    sale, rows of the sale) and whose write refuses a sale that is no longer current: a
    remembered item then costs nothing (no database round trip, even for a sold-out answer),
    and one whose sale was restarted meanwhile is noticed and read again (SaleRestarted).
    """
    entry = _remembered.get(sku)
    now = time.monotonic()
    if entry is not None and entry[0] > now:
        return entry[1], entry[2]
    found = checkout_item(sku)
    memory = ITEM_MEMORY_MS
    if found is not None and memory > 0 and _may_remember(found[0]):
        _remembered[sku] = (now + memory / 1000, *found)
    else:
        _remembered.pop(sku, None)
    return found


def _may_remember(item: Item) -> bool:
    return item.current_sale_id is not None and get_strategy(item.strategy).item_may_be_remembered


def forget_item(sku: str) -> None:
    """Drop this process's remembered reads of sku (its sale was restarted or restocked): the
    checkouts' and the item page's (`selectors.item_page`)."""
    _remembered.pop(sku, None)
    forget_item_page(sku)


def _replay(key: str | None, *, sku: str, qty: int, buyer: str) -> Order | None:
    """The order an earlier checkout with this key placed, if any; InvalidRequest when that
    checkout was for something else."""
    if not key:
        return None
    order = Order.objects.select_related("item").filter(idempotency_key=key).order_by().first()
    if order is None:
        return None
    if (order.item.sku, order.qty, order.buyer) != (sku, qty, buyer):
        raise InvalidRequest(
            f"idempotency_key {key!r} was used for another checkout "
            f"({order.item.sku} x{order.qty} for {order.buyer})"
        )
    return order


def checkout_item(sku: str) -> tuple[Item, Opening | None] | None:
    """The item sold as sku and its sale's opening (None without a sale), or None when there
    is no such item. It runs for every checkout: one hand-written, prepared query
    (`fastpath.read_checkout_item`), which also reads how far the opening is by the database's
    clock (and tells `deadline` how that clock reads against this host's)."""
    found = read_checkout_item(sku)
    if found is None:
        return None
    item, opening = found
    if opening is None:
        return item, None
    deadline.on_database_clock(*opening)
    return item, Opening(*opening)


def _violated_constraint(exc: IntegrityError) -> str | None:
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None)


@transaction.atomic
def start_sale(
    *,
    sku: str,
    stock: int,
    strategy: str | None = None,
    limit: int | None = None,
    name: str | None = None,
    price: Decimal | None = None,
    opens_in: float = 0,
) -> Sale:
    """(Re)start the sale of sku: create the item if new, open a new sale with its stock,
    strategy (FLASHSALE_DEFAULT_STRATEGY when none is named) and limit (and stock rows of its
    own when the strategy keeps them), and warm Redis once committed. Earlier sales keep their
    orders, stock rows and allowances as history.

    Safe while checkouts of the previous sale are in flight: the item row is locked without
    blocking their foreign-key checks (FOR NO KEY UPDATE), and nothing they may hold locked is
    touched. A sale statement that read the item before the restart refuses (it guards the sale
    it was read for), so no unit is taken from one sale and recorded under another.

    Raises InvalidRequest for a bad argument; nothing is written then.
    """
    strategy = strategy or settings.FLASHSALE_DEFAULT_STRATEGY
    _validate_sale(sku=sku, stock=stock, strategy=strategy, limit=limit, price=price)
    longest = Item._meta.get_field("name").max_length or 0
    if name is not None and (len(name) > longest or not name.isprintable()):
        raise InvalidRequest(f"name: at most {longest} printable characters")
    if not 0 <= opens_in <= 7 * 24 * 3600:
        raise InvalidRequest("opens in: from 0 seconds to a week")
    selling = get_strategy(strategy)
    item, _ = Item.objects.select_for_update(no_key=True).get_or_create(
        sku=sku, defaults={"name": name or sku.replace("-", " ").title()}
    )
    sale = Sale.objects.create(
        item=item,
        initial_stock=stock,
        strategy=strategy,
        per_buyer_limit=limit,
        opens_at=database_now() + timedelta(seconds=opens_in),
    )
    item.stock = stock
    item.version += 1
    item.strategy = strategy
    item.per_buyer_limit = limit
    item.shard_count = selling.shard_count
    item.current_sale = sale
    fields = ["stock", "version", "strategy", "per_buyer_limit", "shard_count", "current_sale"]
    if name:
        item.name = name
        fields.append("name")
    if price is not None:
        item.price = price
        fields.append("price")
    item.save(update_fields=fields)
    if item.shard_count:
        StockShard.objects.bulk_create(
            StockShard(item=item, sale=sale, index=index, stock=units, supplied=units)
            for index, units in enumerate(split_stock(stock, item.shard_count))
        )
    # This process forgets its read of the item at once and again once committed; other
    # processes notice the restart on their next checkout (SaleRestarted).
    forget_item(sku)
    transaction.on_commit(lambda: forget_item(sku))
    transaction.on_commit(lambda: warm_redis(item))
    return sale


#: The most units one restock adds.
MAX_RESTOCK = 10**9


def restock(*, sku: str, units: int) -> Sale:
    """Add units to sku's running sale, safely under traffic; return the sale.

    The units go to the item row, or are spread over the sale's stock rows, in one transaction
    that locks what it writes in the order every writer does (the stock rows in index order,
    then the item row), so it waits for in-flight sales rather than racing them. Redis hears
    of the units after the commit, by increments (never a SET that could undo a take in
    flight): until then, or if Redis misses them, it only holds fewer units than the
    database, which sells fewer, never too many (the reconciler catches it up).

    Raises UnknownSku, NotOnSale, InvalidRequest (units not from 1 to MAX_RESTOCK), or Busy
    when the sale was restarted meanwhile; nothing is written then.
    """
    if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= MAX_RESTOCK:
        raise InvalidRequest(f"units to add: a whole number from 1 to {MAX_RESTOCK}")
    with transaction.atomic():
        item = Item.objects.filter(sku=sku).first()
        if item is None:
            raise UnknownSku(sku)
        if item.current_sale_id is None:
            raise NotOnSale(sku)
        sale_id = item.current_sale_id
        added_rows: dict[int, int] = {}
        if item.shard_count:
            stock.shard_stocks(sale_id, for_update=True)
            shares = split_stock(units, item.shard_count)
            added_rows = {index: share for index, share in enumerate(shares) if share}
            for index, share in added_rows.items():
                StockShard.objects.filter(sale_id=sale_id, index=index).update(
                    stock=F("stock") + share,
                    supplied=F("supplied") + share,
                    version=F("version") + 1,
                )
        current = Item.objects.select_for_update(no_key=True).filter(
            pk=item.pk, current_sale_id=sale_id
        )
        if not current.exists():
            raise Busy(f"{sku}: its sale was restarted during the restock")
        if not item.shard_count:
            current.update(stock=F("stock") + units, version=F("version") + 1)
        Sale.objects.filter(pk=sale_id).update(added_stock=F("added_stock") + units)
        strategy = get_strategy(item.strategy)
        transaction.on_commit(lambda: _tell_redis(strategy, item, units, added_rows))
        transaction.on_commit(lambda: forget_item_page(sku))
    return Sale.objects.select_related("item").get(pk=sale_id)


def _tell_redis(strategy, item: Item, units: int, added_rows: dict[int, int]) -> None:
    try:
        strategy.add_units(item=item, units=units, rows=added_rows)
    except REDIS_DOWN_ERRORS as exc:
        logger.warning(
            "%s: Redis missed a restock of %s units (%s): reconcile", item.sku, units, exc
        )


def _validate_sale(
    *, sku: str, stock: int, strategy: str, limit: int | None, price: Decimal | None
) -> None:
    from django.core.exceptions import ValidationError
    from django.core.validators import validate_slug

    try:
        validate_slug(sku)
    except ValidationError:
        raise InvalidRequest(f"sku {sku!r}: use letters, digits, '-' and '_' only") from None
    if len(sku) > (Item._meta.get_field("sku").max_length or 0):
        raise InvalidRequest("sku: at most 64 characters")
    if strategy not in strategy_names():
        raise InvalidRequest(
            f"unknown strategy {strategy!r}; choose one of {', '.join(strategy_names())}"
        )
    if isinstance(stock, bool) or not isinstance(stock, int) or not 0 <= stock <= 10**9:
        raise InvalidRequest("stock: a whole number from 0 to 1000000000")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidRequest("limit: a whole number of at least 1")
    if price is not None and (
        not Decimal(price).is_finite() or price < 0 or price >= Decimal("1e8")
    ):
        raise InvalidRequest("price: from 0 to 99999999.99")


def warm_redis(item: Item) -> bool:
    """Drop Redis state left by the item's earlier sales and seed the current one's.

    Best effort: with Redis down the sale still runs (through the fallback) and the counters are
    seeded on first use. Returns whether Redis was warmed.
    """
    client = get_redis_client()
    try:
        current = keys.current_sale_prefix(item)
        stale = [
            key
            for key in client.scan_iter(match=keys.every_sale_pattern(item), count=500)
            if not key.decode().startswith(current)
        ]
        if stale:
            client.delete(*stale)
        get_strategy(item.strategy).sync_redis(item=item)
    except REDIS_DOWN_ERRORS as exc:
        logger.warning("sale of %s started without warming Redis (%s)", item.sku, exc)
        return False
    return True
