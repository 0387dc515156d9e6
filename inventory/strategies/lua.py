"""`lua`: one atomic script takes the units from Redis counters; no lock at all.

The sale's units live in stock rows (stripes: FLASHSALE_STRIPES rows in the database, one Redis
counter each). The script takes the units from one counter that holds them all, the counters
tried in turn, so concurrent buyers land on different rows; the database write that follows
decrements that row only, guarded by `stock >= units`. No database row is written by every
buyer: lua pays for Redis and its own row, not for a queue on the item row.

Group commit (FLASHSALE_GROUP_COMMIT, off by default): the same script also queues the sale in
Redis, and whichever buyer finds the combiner lock free writes the queued sales of all web
processes in one statement and one commit (`inventory.stock.sell_batch`), then answers each
buyer; the others wait for their answer, which comes only once their order row is committed.
So a buyer costs one script and one wait in Redis, and the database one commit per batch
rather than per sale. Each sale in a batch keeps its own guards (stock row, per-buyer limit,
idempotency key). Once a sale is queued it may be written: from then on a Redis failure is
answered `busy` (a retry with the same idempotency key finds the order), never handed to the
fallback, which could sell the buyer a second unit.

If the database refuses, a counter was too high (it was rebuilt while other processes still
sold through the fallback): the counters are set from the database and the take is tried once
more. If anything else fails before commit, the units go back to the counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, connection
from redis.exceptions import ConnectionError as RedisConnectionError

from locking import Claim, KeyClaimed
from locking.combining import GroupCommit, Queued

from .. import keys, stock, writer
from ..breaker import breaker
from ..exceptions import Busy, LimitReached, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client
from ..stock import HalfDone, Sold, back_off, plan_rows, shard_stocks, simulate_work
from . import plumbing
from .base import Allocation, RecordOrder, StockStrategy
from .plumbing import add_to_rows

logger = logging.getLogger(__name__)

#: Takes tried before a buyer refused by the database is told sold out (or busy).
ATTEMPTS = 2

T = TypeVar("T")


def _write_batch(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`stock.sell_batch`, answering `locked` to every request when a row stayed locked (the
    batch then wrote nothing: its takers give their units back)."""
    try:
        return stock.sell_batch(requests)
    except stock.RowLockTimeout:
        return [{"o": "locked"}] * len(requests)


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


_writer_warned: set[str] = set()


def _writer_unavailable(exc: Exception) -> None:
    """The configured sale writer cannot be reached: checkouts go the direct way meanwhile."""
    message = str(exc)
    if message not in _writer_warned:
        _writer_warned.add(message)
        logger.warning("%s; selling the direct way until it is back", message)


def _release(claim: Claim) -> None:
    try:
        plumbing.counter().release_claim(claim)
    except REDIS_DOWN_ERRORS:
        pass  # it expires on its own; meanwhile a twin waits or is answered busy


def _taken(item: Item, take: Callable[[], T | None]) -> T:
    """What `take` took (units, or a queued sale; empty when sold out). Seeds the counters
    once when Redis lost them, and waits while a twin checkout holds the idempotency claim
    (at most the claim's lifetime, then Busy)."""
    seeded = False
    deadline = None
    pause = 0.001
    while True:
        try:
            taken = take()
        except KeyClaimed as exc:
            now = time.monotonic()
            deadline = deadline or now + exc.claim.ttl_ms / 1000
            if now >= deadline:
                raise Busy(
                    f"{item.sku}: a checkout with the same idempotency key is still in flight",
                    retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
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


class LuaStrategy(StockStrategy):
    name = "lua"
    label = "atomic check-and-DECRBY script over the stripe counters"
    uses_redis = True
    counts_in_redis = True
    shard_count = settings.FLASHSALE_STRIPES
    # Its counters and rows are the sale's own, and its write refuses a sale restarted since:
    # a checkout may use an item read a moment ago, and a sold-out answer costs no database
    # round trip.
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        claim = _claim(item, record)
        try:
            # Inside a caller's transaction a batch would not commit before the answer.
            if not connection.in_atomic_block:
                sale_writer = writer.client()
                if sale_writer is not None:
                    try:
                        return self._take_written(item, qty, record, claim, sale_writer)
                    except writer.WriterUnavailable as exc:
                        _writer_unavailable(exc)
                if settings.FLASHSALE_GROUP_COMMIT:
                    return self._take_grouped(item, qty, record, claim)
            return self._take(item, qty, record, claim)
        finally:
            if claim is not None:
                _release(claim)

    def _take(self, item: Item, qty: int, record: RecordOrder, claim: Claim | None) -> Order:
        counter = plumbing.counter()
        counters = keys.rows(item)
        cursor = keys.turn(item)
        for _ in range(ATTEMPTS):
            plan = _taken(item, lambda: counter.take_spread(cursor, counters, qty, claim=claim))
            if not plan:
                raise SoldOut(sku=item.sku, requested=qty)
            sold = self._record(item, plan, record)
            if sold is not None:
                return sold.order
            # The database holds fewer units than Redis granted: the counters were too high.
            self._resync(item)
        return self._refused(item, qty, record)

    def _take_grouped(
        self, item: Item, qty: int, record: RecordOrder, claim: Claim | None
    ) -> Order:
        group = plumbing.group_commit(item)
        counters = keys.rows(item)
        cursor = keys.turn(item)
        request = record.request(served_by=self.name)
        for _ in range(ATTEMPTS):
            queued = _taken(
                item,
                lambda: group.take_and_enqueue(
                    cursor=cursor, counters=counters, qty=qty, request=request, claim=claim
                ),
            )
            if not isinstance(queued, Queued):
                raise SoldOut(sku=item.sku, requested=qty)
            answer = self._settle(item, group, queued)
            outcome = answer["o"]
            if outcome == "sold":
                return plumbing.committed_order(record, request, answer, queued.taken, self.name)
            if outcome == "short":
                self._resync(item)  # Redis granted units the database does not hold
                continue
            self._refuse(item, queued.taken, outcome)
        return self._refused(item, qty, record)

    def _take_written(
        self,
        item: Item,
        qty: int,
        record: RecordOrder,
        claim: Claim | None,
        sale_writer: writer.WriterClient,
    ) -> Order:
        request = writer.sale_request(
            sku=item.sku,
            cursor=keys.turn(item),
            rows=item.shard_count,
            qty=qty,
            claim=claim,
            sale=record.request(served_by=self.name),
        )

        if claim is None and writer.may_hand_off():
            # The writer answers the client (`shop.handoff`): nothing to wait for here.
            raise writer.HandedOff(request)

        def ask() -> dict[str, Any] | None:
            answer = plumbing.ask_writer(sale_writer, request, item.sku)
            outcome = answer["o"]
            if outcome == "claimed" and claim is not None:
                raise KeyClaimed(claim)
            if outcome == "missing":
                return None
            if outcome == "redis_down":  # nothing written, nothing will be: fall back
                raise RedisConnectionError(f"the sale writer's Redis: {answer.get('e')}")
            if outcome == "sold_out":
                return {}
            if outcome in ("invalid", "error"):
                raise RuntimeError(f"the sale writer refused the request: {answer.get('e')}")
            if claim is not None:
                claim.held = True  # the take set it
            return answer

        for _ in range(ATTEMPTS):
            answer = _taken(item, ask)
            if not answer:
                raise SoldOut(sku=item.sku, requested=qty)
            taken = {int(index): units for index, units in answer["rows"].items()}
            outcome = answer["o"]
            if outcome == "sold":
                return plumbing.committed_order(record, request["sale"], answer, taken, self.name)
            if outcome == "short":
                self._resync(item)  # Redis granted units the database does not hold
                continue
            self._refuse(item, taken, outcome)
        return self._refused(item, qty, record)

    def _refuse(self, item: Item, taken: dict[int, int], outcome: str) -> None:
        """A batch's refusal of a sale it wrote nothing for: the units go back, and the
        refusal is raised as a direct checkout would raise it."""
        self._give_back(item, taken)
        if outcome == "duplicate":
            raise IntegrityError("idempotency key already used")  # replayed by the caller
        if outcome == "limit":
            raise LimitReached(sku=item.sku, limit=item.per_buyer_limit or 0)
        if outcome == "locked":
            raise stock.RowLockTimeout(f"{item.sku}: a stock row stayed locked")
        raise stock.SaleRestarted(f"{item.sku}: sale {item.current_sale_id} is over")

    def _settle(self, item: Item, group: GroupCommit, queued: Queued) -> dict[str, Any]:
        """The batch's answer to our queued sale; Busy when none can be had."""
        wait = settings.FLASHSALE_GROUP_COMMIT_WAIT_MS / 1000
        try:
            answer = group.settle(queued, _write_batch, wait)
            if answer is None:
                if group.withdraw(queued):  # no combiner took it: it will never be written
                    self._give_back(item, queued.taken)
                    raise Busy(
                        f"{item.sku}: no batch took the sale in time",
                        retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
                    )
                answer = group.answer_for(queued, wait)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            raise Busy(
                f"{item.sku}: Redis failed after the sale was queued ({exc.__class__.__name__})",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            ) from None
        if answer is None or answer["o"] == "failed":
            # Taken by a batch that did not answer or failed: it may be committed or not.
            raise Busy(
                f"{item.sku}: the batch holding the sale did not answer",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            )
        return answer

    def _refused(self, item: Item, qty: int, record: RecordOrder) -> Order:
        """Redis granted units the database refused, twice: its counters lag the database
        (rebuilt while other sales were in flight). Let the database decide, as the fallback
        does: sell from the rows it says hold the units, then set the counters from it."""
        stock.ensure_current(item)
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
            retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
        )

    def _record(self, item: Item, plan: dict[int, int], record: RecordOrder) -> Sold | None:
        try:
            simulate_work()
            return record(Allocation(strategy=self.name, shard_units=plan))
        except HalfDone:
            return None  # refused part way: nothing written, the counters get resynced
        except BaseException:
            self._give_back(item, plan)
            raise

    @staticmethod
    def _seed(item: Item) -> None:
        # Counters are missing when Redis lost them, or when a restart dropped this sale's.
        stock.ensure_current(item)
        levels = shard_stocks(item.current_sale_id)
        pipe = get_redis_client().pipeline(transaction=False)
        for index, units in levels.items():
            pipe.set(keys.row(item, index), units, nx=True)
        pipe.execute()

    def _resync(self, item: Item) -> None:
        try:
            plumbing.sync_rows(item)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not resync %s from the database: Redis is down", item.sku)

    def _give_back(self, item: Item, plan: dict[int, int]) -> None:
        try:
            plumbing.counter().give_back_many({keys.row(item, i): u for i, u in plan.items()})
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            # The counters are now low; rebuilding them from the database when Redis is
            # reachable again restores them.
            logger.warning("could not give %s units of %s back: Redis is down", plan, item.sku)

    def sync_redis(self, *, item: Item, force: bool = False) -> None:
        plumbing.sync_rows(item)

    def return_units(self, *, item: Item, order: Order) -> None:
        plumbing.give_back_rows(item, order)

    def add_units(self, *, item: Item, units: int, rows: dict[int, int]) -> None:
        add_to_rows(item, rows)

    def redis_stock(self, *, item: Item) -> int | None:
        return plumbing.rows_total(item)
