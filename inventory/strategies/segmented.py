"""`segmented`: the stock split over shards, each a stock row of the sale with its own Redis
lock; a buyer walks the ring of shards from a random one (`SegmentedStrategy`).

Each shard's row is the system of record for its units: a sale writes the row(s) it took from
and the order, never the item row. Redis holds a hint per shard, its row's level and version
copied from the database after each commit; a copy never replaces a later version, so the
hints end at the database's levels whatever order the copies land in. Lock order: shard locks
are only waited for in ascending index order while others are held, and a multi-shard sale
decrements its rows in index order too: two buyers cannot deadlock. The first try runs in
batches (`inventory.batching`): docs/decisions/0001-group-commit-in-the-web-process.md.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection

from locking import Lock, release_each_call
from locking.cluster import by_slot, is_cluster
from locking.counter import LockFirst, StockCounter
from locking.scripts import script_for
from locking.scripts.counter import STOCK_SET_NEWER

from .. import deadline, keys
from ..batch_statement import sell_batch
from ..batching import Batcher, Expired
from ..breaker import breaker, remember_unsettled
from ..exceptions import Busy, OutcomeUnknown, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client
from ..sale_values import Allocation, HalfDone, Outcome, Sold, StockRow
from ..stock import ensure_current, shard_rows
from .base import RecordOrder, StockStrategy
from .counters import counter, total
from .locks import acquire_lock, ensure_still_held, fence_of, new_lock, release_quietly
from .waits import simulate_work

logger = logging.getLogger(__name__)

#: Stock rows (shards) of a sale, each with its own lock: ten spread a crowd over ten locks,
#: few enough that the script picking a free one reads every hint in one round trip
#: (docs/decisions/0006).
SHARDS = 10


def shard_lock(item: Item, index: int) -> Lock:
    return new_lock(keys.shard_locks(item)[index], strategy=SegmentedStrategy.name)


# -- group commit ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Checkout:
    """One checkout handed to the batch: what to take, from which shard on, how to record it."""

    item: Item
    qty: int
    record: RecordOrder
    start: int
    deadline: float


@dataclass(frozen=True)
class _Missed:
    """What the first try saw when it did not sell: every shard's hint (None: the hints are
    missing)."""

    hints: list[int] | None


def _lock_first(checkouts: Sequence[_Checkout], tokens: list[str]) -> list[Any]:
    """For each checkout, a free shard holding its quantity locked (`LOCK_FIRST_HOLDING`): one
    round trip for them all on one Redis; on a cluster, where each shard is a slot of its own,
    a call each (`StockCounter.lock_first_holding` walks the shards there)."""
    ttl_ms = settings.FLASHSALE_LOCK_TTL_MS
    calls = [
        LockFirst(keys.shard_hints(c.item), keys.shard_locks(c.item), c.qty, c.start, token, ttl_ms)
        for c, token in zip(checkouts, tokens, strict=True)
    ]
    counters = counter()
    try:
        if not is_cluster(counters.redis):
            return counters.lock_first_holding_many(calls)
        return [
            counters.lock_first_holding(
                call.counters,
                call.locks,
                call.qty,
                start=call.start,
                token=call.token,
                ttl_ms=call.ttl_ms,
            )
            for call in calls
        ]
    except REDIS_DOWN_ERRORS:
        # A lock may have been taken before the reply was lost: released on recovery if ours.
        remember_unsettled(
            (name, token.encode())
            for call, token in zip(calls, tokens, strict=True)
            for name in call.locks
        )
        raise


def _lock_and_write(checkouts: Sequence[_Checkout]) -> list[Sold | _Missed | BaseException]:
    """One batch: a shard locked for each checkout, their sales written by one statement (each
    fenced by its lock) and committed, the locks released with their hints in one call. Answers
    each checkout its sale, or what it saw when it did not sell (no free shard held its
    quantity, its hints were missing, its row turned out short): it then walks the ring."""
    tokens = [uuid.uuid4().hex for _ in checkouts]
    try:
        results = _lock_first(checkouts, tokens)
    except REDIS_DOWN_ERRORS as exc:
        return [exc] * len(checkouts)
    answers: list[Sold | _Missed | BaseException] = []
    held: list[tuple[int, int, int]] = []  # (checkout, shard, fence)
    now = time.monotonic()
    for n, (checkout, (picked, hints, fence)) in enumerate(zip(checkouts, results, strict=True)):
        answers.append(_Missed(hints if picked is not None else None))
        if picked is None or picked < 0 or fence is None:
            continue
        if checkout.deadline <= now:
            answers[n] = deadline.passed(checkout.item.sku)
            _release(checkouts, tokens, [(n, picked, None)])
            continue
        held.append((n, picked, fence))
    if not held:
        return answers
    sales = [
        checkouts[n].record.request(
            served_by=SegmentedStrategy.name, rows={shard: checkouts[n].qty}, fences={shard: fence}
        )
        for n, shard, fence in held
    ]
    try:
        simulate_work()
        with deadline.bounded_by(min(checkouts[n].deadline for n, _, _ in held)):
            written = sell_batch(sales)
    except BaseException as error:
        _release(checkouts, tokens, [(n, shard, None) for n, shard, _ in held])
        for (n, _, _), sale in zip(held, sales, strict=True):
            if isinstance(error, OutcomeUnknown):
                answers[n] = OutcomeUnknown(sale["public_id"])
            else:
                answers[n] = error
        return answers
    _release(
        checkouts,
        tokens,
        [(n, shard, answer.levels) for (n, shard, _), answer in zip(held, written, strict=True)],
    )
    for (n, shard, _), sale, answer in zip(held, sales, written, strict=True):
        if answer.outcome is Outcome.SOLD:
            assert answer.order_id is not None
            answers[n] = checkouts[n].record.sold(
                order_id=answer.order_id,
                public_id=sale["public_id"],
                served_by=SegmentedStrategy.name,
                shard_units={shard: checkouts[n].qty},
                placed_at=answer.placed_at,
            )
        # Refused (its row short, its lock's token, its buyer's limit or key refused): its
        # `_Missed` stands, and the ring walk writes it alone, which tells them apart.
    return answers


def _release(
    checkouts: Sequence[_Checkout],
    tokens: list[str],
    held: list[tuple[int, int, dict[int, tuple[int, int]] | None]],
) -> None:
    """Release the batch's shard locks in one call, each with its row's hint where its sale
    returned the row's level (`levels`: {shard: (stock, version)})."""
    releases = []
    for n, shard, levels in held:
        item = checkouts[n].item
        hint = {keys.shard_hint(item, shard): levels[shard]} if levels and shard in levels else {}
        _, hint_keys, hint_args = StockCounter.set_newer_call(hint)
        releases.append((keys.shard_locks(item)[shard], tokens[n], hint_keys, hint_args))
    client = get_redis_client()
    # On a cluster each lock and its hint share a slot of their own: a call each.
    calls = [releases] if not is_cluster(client) else [[release] for release in releases]
    try:
        for group in calls:
            source, names, args = release_each_call(STOCK_SET_NEWER, group)
            script_for(client, source)(keys=names, args=args)
    except REDIS_DOWN_ERRORS as exc:
        breaker.record_failure(exc)
        remember_unsettled((name, token.encode()) for name, token, _, _ in releases)
        logger.warning("could not release %d shard locks: Redis is down", len(releases))


_batcher: Batcher[_Checkout, Sold | _Missed] = Batcher(_lock_and_write)


def _first_try(checkout: _Checkout) -> Sold | _Missed:
    """Step 1 for the checkout, in a batch of the process's checkouts in flight. Inside a
    caller's transaction it runs alone, on the caller's connection: a batch led from a
    transaction would commit others' sales with it."""
    if connection.in_atomic_block:
        (answer,) = _lock_and_write([checkout])
        if isinstance(answer, BaseException):
            raise answer
        return answer
    try:
        return _batcher.submit(checkout, deadline=checkout.deadline)
    except Expired:
        raise deadline.passed(checkout.item.sku) from None


class SegmentedStrategy(StockStrategy):
    """A buyer starts at a random shard and walks the ring:

    1. shards whose hint covers the whole quantity and whose lock is free right now: take one,
       serve from it; if the database finds it short, correct its hint and move on;
    2. then wait (up to FLASHSALE_LOCK_WAIT_MS in all) for the busy ones among those;
    3. when no single shard holds the quantity (or all that seemed to were short), lock every
       shard in index order and serve from several, lowest index first.

    Sold out only when the shards together hold fewer units than asked.

    Step 1 runs as a batch of the checkouts in flight in one web process (`_lock_and_write`):
    one round trip to Redis locks a shard for each (`StockCounter.lock_first_holding_many`),
    one statement writes their sales, each fenced by its lock's token, and commits
    (`inventory.batch_statement`), one call releases the locks with their hints. A lone
    checkout is a batch of one. A checkout the batch did not sell (no free shard held its
    quantity, or its row was short) goes on to steps 2 and 3 on its own, with `locking.Lock`
    objects (and their watchdogs) for the shards it waits for. A hint is lower than its row
    only between a give-back's commit and its copy (or after a crash, which the rebuild on
    recovery repairs).
    """

    name = "segmented"
    label = f"{SHARDS} shards, one Redis lock each"
    uses_redis = True
    holds_locks = True
    counts_in_redis = True
    shard_count = SHARDS
    # Hints, locks and rows are the sale's own, and its write refuses a sale restarted since:
    # a checkout may use an item read a moment ago.
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        if not item.shard_count:
            raise RuntimeError(f"{item.sku} has no stock shards: restart its sale")
        start = random.randrange(item.shard_count)
        first = _first_try(_Checkout(item, qty, record, start, deadline.current()))
        if isinstance(first, Sold):
            return first.order
        hints = first.hints
        if hints is None:
            # Redis lost the hints, or a restart dropped this sale's: only rebuild a current
            # sale's.
            ensure_current(item)
            hints = _refresh_hints(item)
        if sum(hints) < qty:
            raise SoldOut(sku=item.sku, requested=qty, remaining=sum(hints))

        give_up = time.monotonic() + settings.FLASHSALE_LOCK_WAIT_MS / 1000
        ring = [(start + step) % item.shard_count for step in range(item.shard_count)]
        busy: list[int] = []
        for index in ring:
            if hints[index] < qty:
                continue
            lock = shard_lock(item, index)
            if not acquire_lock(lock, blocking=False):
                busy.append(index)
                continue
            order = self._serve_locked(item, qty, record, {index: qty}, {index: lock})
            if order is not None:
                return order
        for index in busy:
            remaining_wait = give_up - time.monotonic()
            if remaining_wait <= 0:
                break
            lock = shard_lock(item, index)
            if not acquire_lock(lock, blocking_timeout=remaining_wait):
                continue
            order = self._serve_locked(item, qty, record, {index: qty}, {index: lock})
            if order is not None:
                return order
        if busy and time.monotonic() >= give_up:
            raise Busy(
                f"{item.sku}: every shard holding {qty} stayed locked",
            )
        return self._serve_from_all(item, qty, record, give_up)

    def _serve_from_all(self, item: Item, qty: int, record: RecordOrder, give_up: float) -> Order:
        locks: dict[int, Lock] = {}
        hints: dict[int, StockRow] = {}
        try:
            for index in range(item.shard_count):
                lock = shard_lock(item, index)
                if not acquire_lock(lock, blocking_timeout=max(give_up - time.monotonic(), 0.001)):
                    raise Busy(
                        f"{item.sku}: could not lock every shard in time",
                    )
                locks[index] = lock
            rows = shard_rows(item.current_sale_id)
            levels = {index: row.stock for index, row in rows.items()}
            if sum(levels.values()) < qty:
                ensure_current(item)
                _write_hints(item, rows)
                raise SoldOut(sku=item.sku, requested=qty, remaining=sum(levels.values()))
            plan: dict[int, int] = {}
            needed = qty
            for index in sorted(levels):
                if needed and levels[index]:
                    plan[index] = min(levels[index], needed)
                    needed -= plan[index]
            order = self._serve(item, qty, record, plan, locks, hints)
            if order is None:  # only a write outside the locks (the fallback) can cause this
                raise Busy(
                    f"{item.sku}: shards changed under their locks",
                )
            return order
        finally:
            _release_with_hints(item, dict(reversed(locks.items())), hints)

    def _serve_locked(
        self,
        item: Item,
        qty: int,
        record: RecordOrder,
        plan: dict[int, int],
        locks: dict[int, Lock],
    ) -> Order | None:
        hints: dict[int, StockRow] = {}
        try:
            return self._serve(item, qty, record, plan, locks, hints)
        finally:
            _release_with_hints(item, locks, hints)

    def _serve(
        self,
        item: Item,
        qty: int,
        record: RecordOrder,
        plan: dict[int, int],
        locks: dict[int, Lock],
        hints: dict[int, StockRow],
    ) -> Order | None:
        """Take the planned units in one statement, fenced by each shard's lock (`locks`, by
        shard index); None if a shard was short, or refused a fence (hints fixed). A sale's
        levels go into `hints`, for the release to copy to Redis with the locks."""
        simulate_work()
        for lock in locks.values():
            ensure_still_held(lock, item.sku)
        fences = {index: fence_of(locks[index]) for index in plan}
        shard_fences = (
            {index: fence for index, fence in fences.items() if fence is not None}
            if None not in fences.values()
            else None
        )
        try:
            sold = record(
                Allocation(strategy=self.name, shard_units=plan, shard_fences=shard_fences)
            )
        except HalfDone:
            sold = None
        if sold is None:
            rows = shard_rows(item.current_sale_id)
            remaining = sum(row.stock for row in rows.values())
            if remaining < qty:
                ensure_current(item)
                self._write_hints_quietly(item, rows)
                raise SoldOut(sku=item.sku, requested=qty, remaining=remaining)
            self._write_hints_quietly(item, rows)
            return None
        hints.update(
            {
                index: StockRow(stock=left, version=sold.shard_versions[index])
                for index, left in sold.shard_levels.items()
            }
        )
        return sold.order

    def _write_hints_quietly(self, item: Item, rows: dict[int, StockRow]) -> None:
        try:
            _write_hints(item, rows)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not update %s shard hints: Redis is down", item.sku)

    def sync_redis(self, *, item: Item, force: bool = False) -> None:
        _refresh_hints(item, force=force)

    def return_units(self, *, item: Item, order: Order) -> None:
        # The rows hold the units again (committed): copy them. Doing it twice changes nothing.
        indexes = [int(index) for index in order.shard_units or {}]
        if indexes:
            _refresh_hints(item, indexes, create=False)

    def add_units(self, *, item: Item, units: int, rows: dict[int, int]) -> None:
        if rows:
            _refresh_hints(item, rows, create=False)

    def redis_stock(self, *, item: Item) -> int | None:
        return total(keys.shard_hints(item))


# -- the hints ---------------------------------------------------------------------------------


def _write_hints(
    item: Item, rows: dict[int, StockRow], *, create: bool = True, force: bool = False
) -> list[int]:
    """Copy the rows' levels read from the database to their hints, unless a hint holds a
    later version of its row already (see `StockCounter.set_newer`); return every row's level
    as given (0 where not given)."""
    counter().set_newer(
        {keys.shard_hint(item, index): (row.stock, row.version) for index, row in rows.items()},
        create=create,
        force=force,
    )
    return [rows[index].stock if index in rows else 0 for index in range(item.shard_count)]


def _refresh_hints(
    item: Item,
    indexes: Iterable[int] | None = None,
    *,
    create: bool = True,
    force: bool = False,
) -> list[int]:
    """`_write_hints` from the rows as the database holds them now (those in `indexes`)."""
    return _write_hints(item, shard_rows(item.current_sale_id, indexes), create=create, force=force)


def _release_with_hints(item: Item, locks: dict[int, Lock], rows: dict[int, StockRow]) -> None:
    """Release each shard's lock (`release_quietly`), its hint copied from `rows` (the levels
    its holder's statement returned) in the same call to Redis where the lock is ours and on
    the hint's slot: one round trip per shard instead of two, and the next holder finds the
    hint current. Hints of shards not locked here, or behind another kind of lock, are written
    on their own first."""
    alone: dict[int, StockRow] = {}
    paired: dict[int, tuple[str, list[Any], list[Any]]] = {}
    for index, row in rows.items():
        lock = locks.get(index)
        hint = keys.shard_hint(item, index)
        if not isinstance(lock, Lock) or (
            is_cluster(get_redis_client()) and len(by_slot([hint, lock.name], str)) > 1
        ):
            alone[index] = row
            continue
        paired[index] = counter().set_newer_call({hint: (row.stock, row.version)})
    if alone:
        try:
            _write_hints(item, alone)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not update %s shard hints: Redis is down", item.sku)
    for index, lock in locks.items():
        release_quietly(lock, after=paired.get(index))
