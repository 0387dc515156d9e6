"""Publishing committed orders to the order workers: many orders per broker message.

The order row committed at checkout is the outbox; what is published here is only a nudge to
the workers (`inventory.tasks`), and what is never published the sweeper publishes again.
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing import util as multiprocessing_util

import redis
from celery import current_app
from django.conf import settings
from kombu.exceptions import KombuError

from .breaker import broker_breaker

logger = logging.getLogger(__name__)

_PUBLISH_ERRORS = (KombuError, OSError, redis.exceptions.RedisError)

#: The tasks checkout and the sweeper publish, named as Celery registers them (`inventory.tasks`
#: imports the order services, so they are never imported back; tests check the names are
#: registered).
PROCESS_ORDER_TASK = "inventory.tasks.process_order_task"
SETTLE_ORDERS_TASK = "inventory.tasks.settle_orders_task"
GIVE_BACK_TASK = "inventory.tasks.give_back_task"

#: Most orders in one message, which a worker settles as one batch: a bound on a message's
#: size and on how long one batch's transaction holds its orders' rows (docs/decisions/0008).
PUBLISH_BATCH = 200


def publish(task: str, argument: int | list[int], *, what: str) -> bool:
    """Send task(argument) through the broker breaker; False (and logged) if the broker is down.
    A task's message carries order keys only (an order's, or a batch's): the worker reads the
    rows, which are the outbox."""
    if not broker_breaker.allow():
        return False
    try:
        current_app.send_task(task, (argument,), retry=False)
    except _PUBLISH_ERRORS as exc:
        broker_breaker.record_failure(exc)
        logger.warning("%s not enqueued (%s): the sweeper will", what, exc)
        return False
    broker_breaker.record_success()
    return True


def publish_orders(order_pks: list[int]) -> bool:
    """Publish one task that settles the orders as a batch; False if the broker is down."""
    return publish(SETTLE_ORDERS_TASK, order_pks, what=f"{len(order_pks)} orders")


class OrderPublisher:
    """Publishes checkout's orders from a background thread, many orders per broker message.

    Building and sending a Celery message costs about as much CPU as the rest of a checkout;
    here a request only appends the order's key to a list. Every
    FLASHSALE_PUBLISH_INTERVAL_MS the thread sends what has gathered as one
    `settle_orders_task`, which a worker pays and confirms as one batch (`settle_orders`).

    Nothing is promised beyond the commit: an order whose key is lost with its process (killed
    before the next flush), or refused by a broker that is
    down, stays pending in the database, which is the outbox, and the sweeper enqueues it again.
    """

    #: How long a process's exit waits for a send its thread has begun (a broker that answers
    #: takes milliseconds; one that does not, its connect timeout).
    EXIT_WAIT_SECONDS = 10.0

    def __init__(self, *, background: bool = True) -> None:
        #: False: no thread; whoever adds orders calls `flush`.
        self.background = background
        self._lock = threading.Lock()
        #: Held for the whole of a flush: the one on the way out waits for the thread's.
        self._flushing = threading.Lock()
        self._pending: list[int] = []
        self._wake = threading.Event()
        self._pid: int | None = None
        self._stopped = False

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's thread and pending keys are not ours."""
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._pending = []
        self._pid = None

    def add(self, order_pk: int) -> None:
        self.add_many([order_pk])

    def add_many(self, order_pks: list[int]) -> None:
        with self._lock:
            if self.background and self._pid != os.getpid():
                # First use in this process, or in a forked child, which has no thread.
                self._pid = os.getpid()
                self._pending = []
                self._wake = threading.Event()
                threading.Thread(target=self._run, name="order-publisher", daemon=True).start()
                # A process that exits cleanly (a server's worker recycled or stopped) sends
                # what it holds instead of leaving it to the sweeper. A finalizer, not atexit:
                # it runs at the interpreter's exit and also where atexit never does, at the
                # end of a multiprocessing child (granian's workers are).
                multiprocessing_util.Finalize(None, self.flush_on_exit, exitpriority=10)
            self._pending += order_pks
            if len(self._pending) >= PUBLISH_BATCH:
                self._wake.set()

    def _run(self) -> None:
        wake = self._wake
        while not self._stopped:
            wake.wait(settings.FLASHSALE_PUBLISH_INTERVAL_MS / 1000)
            wake.clear()
            try:
                self.flush()
            except Exception:  # never let the thread die: the next flush may work
                logger.exception("publishing orders failed")

    def stop(self) -> int:
        """End the thread (if any) and send what is left; return how many went out."""
        self._stopped = True
        self._wake.set()
        return self.flush()

    def flush(self) -> int:
        """Send every order gathered so far; return how many went out."""
        with self._flushing:
            return self._send_pending()

    def flush_on_exit(self) -> int:
        """`flush`, at the process's exit: first wait for a send the thread has begun, which
        the interpreter would otherwise cut short (its thread is a daemon), losing the orders
        it had taken to the sweeper. A send that hangs longer than EXIT_WAIT_SECONDS is left."""
        if self._flushing.acquire(timeout=self.EXIT_WAIT_SECONDS):
            try:
                return self._send_pending()
            finally:
                self._flushing.release()
        logger.warning("a publish still hangs at exit: sending what is left beside it")
        return self._send_pending()

    def _send_pending(self) -> int:
        with self._lock:
            batch, self._pending = self._pending, []
        size = PUBLISH_BATCH
        sent = 0
        for start in range(0, len(batch), size):
            chunk = batch[start : start + size]
            if not publish_orders(chunk):
                logger.warning("%s orders not enqueued: the sweeper will", len(batch) - sent)
                break
            sent += len(chunk)
        return sent


def hand_over(order_pks: list[int], publisher: OrderPublisher) -> None:
    """Hand just-committed orders to the workers: through `publisher`, or with an interval of
    0, at once, one message per PUBLISH_BATCH orders."""
    if settings.FLASHSALE_PUBLISH_INTERVAL_MS <= 0:
        size = PUBLISH_BATCH
        for start in range(0, len(order_pks), size):
            publish_orders(order_pks[start : start + size])
    else:
        publisher.add_many(order_pks)
