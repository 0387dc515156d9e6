"""`POST /api/checkout` as an async view, for an ASGI server (`shop.asgi`): `lua`'s take and
write batched on the process's event loop.

The checkouts in flight in one process join one batch: while a batch's script runs on Redis
(`redis.asyncio`) and its statement on PostgreSQL (one `psycopg.AsyncConnection` per process),
the requests that arrive wait for the next. A checkout on this path sells a `lua` item read a
moment ago (`services._remembered`), with no idempotency key, Redis's breaker closed; every other
checkout, and every rarer outcome of a batch (units given back first), is served by the sync
view in a thread (`sync_to_async`). Measured against the server designs it would replace
(`manage.py bench servers`, design `uvicorn`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import redis.asyncio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import NoScriptError

from locking import scripts
from locking.counter import Take, take_spread_many_arguments, take_spread_many_results

from . import api, keys, metrics, selectors, services, stock
from .breaker import breaker
from .exceptions import CheckoutError, SoldOut
from .models import Item
from .orders import order_placed

logger = logging.getLogger(__name__)

#: The most checkouts one batch writes.
MOST = 64


@dataclass(eq=False)
class _Checkout:
    item: Item
    record: stock.SaleRecorder


class _Connections:
    """This process's Redis client and database connection for batches, opened on first use."""

    def __init__(self) -> None:
        self.redis: Any = None
        self.database: psycopg.AsyncConnection[Any] | None = None
        self.script = scripts.STOCK_TAKE_SPREAD_MANY
        self.sha: str | None = None

    async def take(self, takes: list[Take]) -> list[Any]:
        if self.redis is None:
            self.redis = redis.asyncio.Redis.from_url(settings.REDIS_URL)
        if self.sha is None:
            self.sha = await self.redis.script_load(self.script)
        names, args = take_spread_many_arguments(takes)
        try:
            reply = await self.redis.evalsha(self.sha, len(names), *names, *args)
        except NoScriptError:
            self.sha = await self.redis.script_load(self.script)
            reply = await self.redis.evalsha(self.sha, len(names), *names, *args)
        return take_spread_many_results(takes, reply)

    async def write(self, sales: list[dict[str, Any]]) -> tuple[list[tuple[str, int, Any]], Any]:
        if self.database is None or self.database.closed:
            database = settings.DATABASES["default"]
            self.database = await psycopg.AsyncConnection.connect(
                dbname=database["NAME"],
                user=database["USER"] or None,
                password=database["PASSWORD"] or None,
                host=database["HOST"] or database.get("OPTIONS", {}).get("host") or None,
                port=database["PORT"] or None,
                autocommit=True,
            )
        wait = f"{settings.FLASHSALE_ROW_LOCK_TIMEOUT_MS}ms"
        at = timezone.now()
        parameters = stock._batch_parameters(sales, at, wait)
        async with self.database.cursor() as cursor:
            await cursor.execute(stock._BATCH_SQL, parameters, prepare=True)
            return await cursor.fetchall(), at


_connections = _Connections()


@dataclass
class _Answer:
    taken: dict[int, int]
    order_id: int | None = None
    public_id: str = ""
    placed_at: Any = None
    sold_out: bool = False


class _Batches:
    """One batch at a time per process; what arrives meanwhile goes in the next."""

    def __init__(self) -> None:
        self.waiting: list[tuple[_Checkout, asyncio.Future[_Answer]]] = []
        self.writing = False

    async def submit(self, checkout: _Checkout) -> _Answer:
        future: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        self.waiting.append((checkout, future))
        if not self.writing:
            self.writing = True
            asyncio.get_running_loop().create_task(self._lead())
        return await future

    async def _lead(self) -> None:
        try:
            while self.waiting:
                batch, self.waiting = self.waiting[:MOST], self.waiting[MOST:]
                try:
                    answers: list[Any] = await _take_and_write([c for c, _ in batch])
                except BaseException as error:  # every checkout's answer
                    answers = [error] * len(batch)
                for (_, future), answer in zip(batch, answers, strict=True):
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
        finally:
            self.writing = False


_batches = _Batches()


async def _take_and_write(checkouts: list[_Checkout]) -> list[_Answer | BaseException]:
    takes = [Take(keys.turn(c.item), keys.rows(c.item), c.record.qty) for c in checkouts]
    results = await _connections.take(takes)
    answers: list[_Answer | BaseException] = []
    writes: list[tuple[int, _Checkout, dict[int, int]]] = []
    for checkout, result in zip(checkouts, results, strict=True):
        if result is None:
            answers.append(_Answer({}))  # counters missing: the sync path seeds them
        elif not result:
            answers.append(_Answer({}, sold_out=True))
        else:
            writes.append((len(answers), checkout, result))
            answers.append(_Answer(result))
    if not writes:
        return answers
    sales = [
        {**checkout.record.request(served_by="lua"), "rows": plan} for _, checkout, plan in writes
    ]
    try:
        rows, at = await _connections.write(sales)
    except psycopg.Error:
        return answers  # refused (or failed): each goes the sync way, its units given back
    placed = {public_id: order_id for public_id, order_id, _ in rows}
    for (n, _, plan), sale in zip(writes, sales, strict=True):
        public_id = sale["public_id"]
        answers[n] = _Answer(plan, placed.get(public_id), public_id, at)
    return answers


def _give_back(item: Item, taken: dict[int, int]) -> None:
    from .strategies.plumbing import counter

    counter().give_back_many({keys.row(item, index): units for index, units in taken.items()})


def _sync_checkout(request: HttpRequest) -> JsonResponse:
    return api.checkout(request)


@csrf_exempt
async def checkout(request: HttpRequest) -> JsonResponse:
    """POST /api/checkout on the event loop where it can be, else the sync view in a thread."""
    if request.method != "POST":
        return api.method_not_allowed(request, "POST")
    started = time.perf_counter()
    try:
        parsed = api.parse_checkout(request.body)
    except CheckoutError as error:
        metrics.checkout_answered(metrics.NO_STRATEGY, error.code, time.perf_counter() - started)
        return api.checkout_error_response(error)
    entry = services._remembered.get(parsed.sku)
    fast = (
        entry is not None
        and entry[0] > time.monotonic()
        and entry[1].strategy == "lua"
        and entry[2] is not None
        and entry[2].opens_after <= time.monotonic()
        and not parsed.idempotency_key
        and entry[1].per_buyer_limit is None
        and breaker.allow()
    )
    if not fast:
        return await sync_to_async(_sync_checkout, thread_sensitive=False)(request)
    assert entry is not None
    item = entry[1]
    record = stock.SaleRecorder(item=item, qty=parsed.qty, buyer=parsed.buyer)
    answer = await _batches.submit(_Checkout(item, record))
    if answer.order_id is not None:
        order = record.sold(
            order_id=answer.order_id,
            public_id=answer.public_id,
            served_by="lua",
            shard_units=answer.taken,
            placed_at=answer.placed_at,
        ).order
        order_placed(order.pk)
        metrics.checkout_answered("lua", "accepted", time.perf_counter() - started)
        return JsonResponse(
            selectors.checkout_payload(order),
            status=201,
            headers={"Location": f"/api/orders/{order.public_id}"},
        )
    if answer.sold_out:
        error = SoldOut(sku=item.sku, requested=parsed.qty)
        metrics.checkout_answered("lua", error.code, time.perf_counter() - started)
        return api.checkout_error_response(error)
    if answer.taken:
        await sync_to_async(_give_back, thread_sensitive=False)(item, answer.taken)
    return await sync_to_async(_sync_checkout, thread_sensitive=False)(request)
