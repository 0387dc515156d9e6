"""`lua`: one atomic script takes the units from Redis counters; no lock at all.

The sale's units live in stock rows (stripes: STRIPES rows in the database, one Redis
counter each). The script takes the units from one counter that holds them all, the counters
tried in turn, so concurrent buyers land on different rows; the database write that follows
decrements that row only, guarded by `stock >= units`. No database row is written by every
buyer: lua pays for Redis and its own row, not for a queue on the item row.

Group commit: the checkouts in flight in one web process are taken and written together
(`inventory.batching`, docs/decisions/0001-group-commit-in-the-web-process.md): one script
takes every checkout's units (`StockCounter.take_spread_many`), one statement writes every
sale that got units and commits (`inventory.batch_statement`), each sale with its own guards.
A lone checkout is a batch of one, and so is one inside a caller's transaction (written on its
own connection, as part of that transaction).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import TypeVar

from django.conf import settings
from django.db import IntegrityError, connection

from locking import Claim, KeyClaimed
from locking.counter import Take

from .. import deadline, keys
from ..batch_statement import sell_batch
from ..batching import Batcher, Expired
from ..breaker import breaker
from ..exceptions import Busy, LimitReached, OutcomeUnknown, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client
from ..sale_values import Allocation, HalfDone, Outcome, SaleRestarted, Sold
from ..stock import ensure_current, plan_rows, shard_stocks
from .ahead import IDLE_SECONDS, Holding, held_elsewhere, holders, holding
from .base import RecordOrder, StockStrategy
from .counters import counter, holder_registry, total
from .waits import back_off, simulate_work

logger = logging.getLogger(__name__)

#: Takes tried before a buyer refused by the database is told sold out (or busy).
ATTEMPTS = 2
#: How long a checkout that found the counters short takes again while another process holds
#: units of the sale, before it is answered busy: a holder sells them, or gives them back once
#: unused for IDLE_SECONDS, and at once when its own take comes back short.
HELD_WAIT_SECONDS = 4 * IDLE_SECONDS
#: Stock rows (stripes) of a sale, one Redis counter each: ten spread the database writes of
#: concurrent buyers over ten rows, few enough for one script to try every counter.
STRIPES = 10

T = TypeVar("T")


def _claim(item: Item, record: RecordOrder) -> Claim | None:
    """The claim a checkout with an idempotency key takes with its units, so that a retry
    racing it (same key) waits for its order instead of answering before it: without it, a
    retry that finds the last unit gone while its twin still writes the order would answer
    sold out to a client that holds an order. It lasts as long as a lock would."""
    if not record.idempotency_key:
        return None
    return Claim(
        key=keys.claim(item, record.idempotency_key),
        ttl_ms=settings.FLASHSALE_LOCK_TTL_MS,
    )


def _release(claim: Claim) -> None:
    try:
        counter().release_claim(claim)
    except REDIS_DOWN_ERRORS:
        pass  # it expires on its own; meanwhile a twin waits or is answered busy


def _taken(item: Item, take: Callable[[], T | None]) -> T:
    """What `take` took (units, or a batch's answer; empty when sold out). Seeds the counters
    once when Redis lost them, and waits while a twin checkout holds the idempotency claim
    (at most the claim's lifetime, then Busy)."""
    seeded = False
    give_up = None
    pause = 0.001
    while True:
        try:
            taken = take()
        except KeyClaimed as exc:
            now = time.monotonic()
            give_up = give_up or now + exc.claim.ttl_ms / 1000
            if now >= min(give_up, deadline.current()):
                raise Busy(
                    f"{item.sku}: a checkout with the same idempotency key is still in flight",
                ) from None
            time.sleep(pause)  # the twin needs a statement or two: a few ms
            pause = min(pause * 2, 0.02)
            continue
        if taken is not None:
            return taken
        if seeded:
            raise Busy(f"{item.sku}: stock counters are being rebuilt")
        # Redis restarted empty or was never warmed: seed it from the database, once.
        LuaStrategy._seed(item)
        seeded = True


# -- group commit ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Checkout:
    """One checkout handed to the batch: what to take, and how to record it."""

    item: Item
    qty: int
    record: RecordOrder
    claim: Claim | None
    deadline: float


class _Took(StrEnum):
    """What the batch's script did for a checkout that it did not get to write."""

    SOLD_OUT = "sold_out"
    #: A counter does not exist (Redis lost them): nothing taken.
    MISSING = "missing"
    #: A twin checkout holds the idempotency key's claim: nothing taken.
    CLAIMED = "claimed"


@dataclass(frozen=True)
class _Answer:
    """A checkout's answer from its batch: the units taken per stock row, and either what the
    script did (`took`) or what the statement did with them (`written`, and the sale)."""

    taken: dict[int, int]
    took: _Took | None = None
    #: Sold out: whether another process holds units of the sale (they may yet be bought).
    held_elsewhere: bool = False
    written: Outcome | None = None
    sold: Sold | None = None


def _take_and_write(
    checkouts: Sequence[_Checkout], *, ahead: Holding | None = None
) -> list[_Answer | BaseException]:
    """One batch: every checkout's units in one script, every sale that got units in one
    statement and one commit. A Redis failure in the script is every checkout's answer (nothing
    was written: each goes to the fallback); a checkout whose deadline passed meanwhile is
    answered Busy, its units given back; one whose take came back short learns whether another
    process holds units of the sale (`_sold_out`).

    With `ahead` (the process's holding), a checkout without an idempotency key is served from
    the units it holds when it can be, and a batch that runs the script takes BATCHES_AHEAD
    times its units more, to hold (`inventory.strategies.ahead`)."""
    try:
        results = _take(checkouts, ahead)
    except REDIS_DOWN_ERRORS as exc:
        return [exc] * len(checkouts)
    answers: list[_Answer | BaseException] = []
    writes: list[tuple[int, _Checkout, dict[int, int]]] = []
    counted: dict[int, bool | BaseException] = {}
    now = time.monotonic()
    for checkout, result in zip(checkouts, results, strict=True):
        if isinstance(result, Claim):
            answers.append(_Answer({}, took=_Took.CLAIMED))
        elif result is None:
            answers.append(_Answer({}, took=_Took.MISSING))
        elif not result:
            answers.append(_sold_out(checkout.item, counted))
        elif checkout.deadline <= now:
            _give_back(checkout.item, result)
            answers.append(deadline.passed(checkout.item.sku))
        else:
            writes.append((len(answers), checkout, result))
            answers.append(_Answer(result))
    if not writes:
        return answers
    sales = [
        checkout.record.request(served_by=LuaStrategy.name, rows=plan)
        for _, checkout, plan in writes
    ]
    try:
        simulate_work()
        with deadline.bounded_by(min(checkout.deadline for _, checkout, _ in writes)):
            written = sell_batch(sales)
    except BaseException as error:
        # Nothing committed (a refusal, a timeout, a lost connection the database says wrote
        # nothing), except when it cannot tell (OutcomeUnknown): then the units stay taken.
        unknown = isinstance(error, OutcomeUnknown)
        for (n, checkout, plan), sale in zip(writes, sales, strict=True):
            if unknown:
                answers[n] = OutcomeUnknown(sale["public_id"])
            else:
                _give_back(checkout.item, plan)
                answers[n] = error
        return answers
    for (n, checkout, plan), sale, answer in zip(writes, sales, written, strict=True):
        sold = None
        if answer.outcome is Outcome.SOLD:
            assert answer.order_id is not None
            sold = checkout.record.sold(
                order_id=answer.order_id,
                public_id=sale["public_id"],
                served_by=LuaStrategy.name,
                shard_units=plan,
                placed_at=answer.placed_at,
            )
        answers[n] = _Answer(plan, written=answer.outcome, sold=sold)
    return answers


def _sold_out(item: Item, counted: dict[int, bool | BaseException]) -> _Answer | BaseException:
    """The answer to a take that found item's counters short: whether another process holds
    units of the sale, counted once a batch for each item (`counted`: item pk -> the count's
    answer, or the Redis error it met, which is then the checkout's answer)."""
    if item.pk not in counted:
        try:
            counted[item.pk] = held_elsewhere(item, holding)
        except REDIS_DOWN_ERRORS as exc:
            counted[item.pk] = exc
    elsewhere = counted[item.pk]
    if isinstance(elsewhere, BaseException):
        return elsewhere
    return _Answer({}, took=_Took.SOLD_OUT, held_elsewhere=elsewhere)


def _take(
    checkouts: Sequence[_Checkout], ahead: Holding | None
) -> list[dict[int, int] | None | Claim]:
    """Each checkout's units (stock row -> units; empty: sold out; None: the counters are
    missing; its claim: a twin holds it), from what `ahead` holds, else from the counters."""
    served = [
        ahead.serve(checkout.item, checkout.qty)
        if ahead is not None and checkout.claim is None
        else None
        for checkout in checkouts
    ]
    asking = [checkout for checkout, plan in zip(checkouts, served, strict=True) if plan is None]
    if not asking:
        return list(served)
    takes = [
        Take(
            keys.turn(checkout.item),
            keys.stripe_counters(checkout.item),
            checkout.qty,
            checkout.claim,
        )
        for checkout in asking
    ]
    # A batch sells one item, as a rule: units are taken ahead for the first checkout's.
    item = asking[0].item
    units = sum(checkout.qty for checkout in asking if checkout.item.pk == item.pk)
    more = ahead.units_to_take(item, units, len(checkouts)) if ahead is not None else 0
    if ahead is None or not more:
        taken = iter(counter().take_spread_many(takes))
    else:
        taken = iter(ahead.take(item, takes, more))
    return [plan if plan is not None else next(taken) for plan in served]


_batcher: Batcher[_Checkout, _Answer] = Batcher(partial(_take_and_write, ahead=holding))


def _ask(checkout: _Checkout) -> _Answer | None:
    """The checkout's answer from a batch (None: the counters are missing; KeyClaimed: a twin
    holds the key's claim). A checkout that finds the counters short while this process holds
    units of the sale ahead gives them back and takes again."""
    answer = _asked(checkout)
    if answer.took is _Took.SOLD_OUT and holding.give_back(checkout.item):
        answer = _asked(checkout)
    if answer.took is _Took.CLAIMED and checkout.claim is not None:
        raise KeyClaimed(checkout.claim)
    if answer.took is _Took.MISSING:
        return None
    return answer


def _asked(checkout: _Checkout) -> _Answer:
    """Inside a caller's transaction a checkout is written alone, on the caller's connection
    (a batch led from a transaction would commit others' sales with it), and holds nothing."""
    if connection.in_atomic_block:
        (answer,) = _take_and_write([checkout])
        if isinstance(answer, BaseException):
            raise answer
        return answer
    try:
        return _batcher.submit(checkout, deadline=checkout.deadline)
    except Expired:
        raise deadline.passed(checkout.item.sku) from None


def _give_back(item: Item, plan: dict[int, int]) -> None:
    try:
        counter().give_back_many({keys.stripe_counter(item, i): u for i, u in plan.items()})
    except REDIS_DOWN_ERRORS as exc:
        breaker.record_failure(exc)
        # The counters are now low; rebuilding them from the database when Redis is
        # reachable again restores them.
        logger.warning("could not give %s units of %s back: Redis is down", plan, item.sku)


class LuaStrategy(StockStrategy):
    """If the database refuses a sale, a counter was too high (it was rebuilt while other
    processes still sold through the fallback): the counters are set from the database and the
    take is tried once more. If anything else fails before commit, the units go back to the
    counters."""

    name = "lua"
    label = "atomic check-and-DECRBY script over the stripe counters"
    uses_redis = True
    counts_in_redis = True
    shard_count = STRIPES
    # Its counters and rows are the sale's own, and its write refuses a sale restarted since:
    # a checkout may use an item read a moment ago, and a sold-out answer costs no database
    # round trip.
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        claim = _claim(item, record)
        checkout = _Checkout(item, qty, record, claim, deadline.current())
        try:
            attempts = waits = 0
            give_up = math.inf
            while attempts < ATTEMPTS:
                answer = _taken(item, lambda: _ask(checkout))
                if answer.took is _Took.SOLD_OUT:
                    if not answer.held_elsewhere:
                        raise SoldOut(sku=item.sku, requested=qty)
                    # Another process holds units of the sale: they are sold or back soon.
                    now = time.monotonic()
                    give_up = min(give_up, now + HELD_WAIT_SECONDS, checkout.deadline)
                    if now >= give_up:
                        raise Busy(f"{item.sku}: its last units are held by another process")
                    back_off(waits)
                    waits += 1
                    continue
                attempts += 1
                if answer.sold is not None:
                    return answer.sold.order
                if answer.written is Outcome.SHORT:
                    self._resync(item)  # Redis granted units the database does not hold
                    continue
                _give_back(item, answer.taken)
                if answer.written is Outcome.DUPLICATE:
                    raise IntegrityError("idempotency key already used")  # replayed by the caller
                if answer.written is Outcome.LIMIT:
                    raise LimitReached(sku=item.sku, limit=item.per_buyer_limit or 0)
                raise SaleRestarted(f"{item.sku}: sale {item.current_sale_id} is over")
            return self._refused(item, qty, record)
        finally:
            if claim is not None:
                _release(claim)

    def _refused(self, item: Item, qty: int, record: RecordOrder) -> Order:
        """Redis granted units the database refused, twice: its counters lag the database
        (rebuilt while other sales were in flight). Let the database decide, as the fallback
        does: sell from the rows it says hold the units, then set the counters from it."""
        ensure_current(item)
        for attempt in range(ATTEMPTS):
            levels = shard_stocks(item.current_sale_id)
            if sum(levels.values()) < qty:
                self._resync(item)
                raise SoldOut(sku=item.sku, requested=qty, remaining=sum(levels.values()))
            try:
                sold = record(Allocation(strategy=self.name, shard_units=plan_rows(levels, qty)))
            except HalfDone:
                sold = None  # another sale took a row between the read and the write
            if sold is not None:
                self._resync(item)
                return sold.order
            back_off(attempt)
        raise Busy(
            f"{item.sku}: its stock rows kept changing under the checkout",
        )

    @staticmethod
    def _seed(item: Item) -> None:
        # Counters are missing when Redis lost them, or when a restart dropped this sale's.
        ensure_current(item)
        levels = shard_stocks(item.current_sale_id)
        pipe = get_redis_client().pipeline(transaction=False)
        for index, units in levels.items():
            pipe.set(keys.stripe_counter(item, index), units, nx=True)
        pipe.execute()

    def _resync(self, item: Item) -> None:
        try:
            _set_counters(item)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not resync %s from the database: Redis is down", item.sku)

    def sync_redis(self, *, item: Item, force: bool = False) -> None:
        _set_counters(item)

    def return_units(self, *, item: Item, order: Order) -> None:
        # Once per order, however often it is asked (a redelivered task): the sale's marker.
        amounts = {
            keys.stripe_counter(item, int(index)): units
            for index, units in (order.shard_units or {}).items()
        }
        if amounts:
            counter().give_back_once(keys.returned_marker(item, order.pk), amounts)

    def add_units(self, *, item: Item, units: int, rows: dict[int, int]) -> None:
        # By increments (a take may run meanwhile); a missing counter stays missing: it is
        # seeded from the database, which has the units already.
        amounts = {
            keys.stripe_counter(item, index): added for index, added in rows.items() if added
        }
        if amounts:
            counter().give_back_many(amounts)

    def redis_stock(self, *, item: Item) -> int | None:
        return total(keys.stripe_counters(item))

    def redis_settled(self, *, item: Item) -> bool:
        # A holder whose lease ran out never gives its units back: only a repair does, which
        # ends every registration (`_set_counters`).
        live, ended = holders(item, remove_ended=True)
        return ended > 0 or live == 0


def _set_counters(item: Item) -> None:
    """Set every stripe counter of the item's sale from its row in the database. The rows
    count the units processes hold ahead: the same script ends their registrations and moves
    the counters' generation, so that what they hold is not given back on top
    (`inventory.strategies.ahead`)."""
    levels = shard_stocks(item.current_sale_id)
    holder_registry().set_counters(
        keys.holders(item),
        keys.generation(item),
        {keys.stripe_counter(item, index): units for index, units in levels.items()},
    )
    holding.drop(item)  # this process's units are among those the rows count
