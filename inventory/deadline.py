"""A checkout's deadline (FLASHSALE_CHECKOUT_DEADLINE_MS): past it the buyer is answered
`503 busy`, and nothing of that checkout is written afterwards.

`place_order` opens it (`checkout_deadline`); whatever waits inside a checkout asks how long it
may (`seconds_left`, `wait_ms`): a lock's wait, a row lock's (`lock_timeout` of its statement),
a batch's turn; a sale statement checks it against the database's clock as it ends
(`time_of_day`), so that one the database held past it writes nothing. Outside a checkout
(commands, tasks, the lab) there is none: waits keep their own bounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from .exceptions import Busy

#: The `time.monotonic()` value the checkout in progress must be answered by, if any.
_deadline: ContextVar[float | None] = ContextVar("checkout_deadline", default=None)


@contextmanager
def checkout_deadline(seconds: float | None = None) -> Iterator[float]:
    """The checkout inside runs against a deadline `seconds` from now (by default
    FLASHSALE_CHECKOUT_DEADLINE_MS); yields it (a `time.monotonic()` value)."""
    if seconds is None:
        seconds = settings.FLASHSALE_CHECKOUT_DEADLINE_MS / 1000
    deadline = time.monotonic() + seconds
    token = _deadline.set(deadline)
    try:
        yield deadline
    finally:
        _deadline.reset(token)


@contextmanager
def bounded_by(moment: float) -> Iterator[None]:
    """What runs inside waits as if its checkout's deadline were `moment` (a batch written for
    several checkouts: the earliest of theirs)."""
    token = _deadline.set(moment)
    try:
        yield
    finally:
        _deadline.reset(token)


def current() -> float:
    """The deadline of the checkout in progress (`math.inf` outside one)."""
    deadline = _deadline.get()
    return math.inf if deadline is None else deadline


def seconds_left() -> float:
    """How long the checkout in progress may still take (`math.inf` outside one)."""
    return current() - time.monotonic()


#: The database's clock at this host's `time.monotonic()` 0, as this process has read it
#: (`on_database_clock`): the latest of its readings, each early by its read's latency.
_database_clock_at_zero: datetime | None = None


def on_database_clock(at: datetime, monotonic: float) -> None:
    """Note that the database's clock read `at` when this host's `time.monotonic()` read
    `monotonic` or earlier (every checkout that reads its sale's opening tells it so,
    `services.checkout_item`). Of all its readings the latest is the closest: a read the
    database held (stopped mid-statement) is one that reads early, and is outdone."""
    global _database_clock_at_zero
    at_zero = at - timedelta(seconds=monotonic)
    if _database_clock_at_zero is None or at_zero > _database_clock_at_zero:
        _database_clock_at_zero = at_zero


def time_of_day() -> datetime | None:
    """The deadline of the checkout in progress as the database's clock will read it (None
    outside one), for a sale statement to check as it ends (`inventory_in_time`, migration
    0017): one the database held past it (stopped, or slow) writes nothing. Counted from the
    database's clock as read, so no host's own clock decides; the host's is used only before
    any checkout has read the database's."""
    moment = current()
    if moment == math.inf:
        return None
    at_zero = _database_clock_at_zero
    if at_zero is None:
        return timezone.now() + timedelta(seconds=moment - time.monotonic())
    return at_zero + timedelta(seconds=moment)


def wait_ms(bound_ms: int, *, sku: str) -> int:
    """`bound_ms`, or less if the deadline comes first; `Busy` once it has passed."""
    left = seconds_left()
    if left <= 0:
        raise passed(sku)
    return max(1, min(bound_ms, math.ceil(left * 1000))) if left != math.inf else bound_ms


def passed(sku: str) -> Busy:
    """The answer to a checkout whose deadline passed before anything of it was written."""
    return Busy(
        f"{sku}: no answer within the checkout's deadline "
        f"({settings.FLASHSALE_CHECKOUT_DEADLINE_MS} ms); nothing was sold",
    )
