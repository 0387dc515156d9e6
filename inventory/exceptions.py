"""Typed checkout errors. Each carries the data a caller needs to answer the buyer."""

from __future__ import annotations

from datetime import datetime


class CheckoutError(Exception):
    """Base of every error a checkout answers with; `code` is the API's error code."""

    code = "error"
    status = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidRequest(CheckoutError):
    code = "invalid"
    status = 400


class UnknownSku(CheckoutError):
    code = "unknown_sku"
    status = 404

    def __init__(self, sku: str) -> None:
        super().__init__(f"no item with sku {sku!r}")
        self.sku = sku


class SoldOut(CheckoutError):
    code = "sold_out"
    status = 409

    def __init__(self, *, sku: str, requested: int, remaining: int | None = None) -> None:
        if remaining:
            detail = f"{sku}: only {remaining} left, {requested} requested"
        else:
            detail = f"{sku} is sold out"
        super().__init__(detail)
        self.requested = requested
        self.remaining = remaining


class LimitReached(CheckoutError):
    code = "limit_reached"
    status = 409

    def __init__(self, *, sku: str, limit: int) -> None:
        super().__init__(f"{sku}: at most {limit} per buyer")
        self.limit = limit


#: Seconds a buyer answered `503 busy` is told to wait (Retry-After): long enough that a crowd
#: retrying at once does not refill the queue it just left, short for a sale that lasts seconds.
BUSY_RETRY_AFTER = 1


class Busy(CheckoutError):
    """Contention outlasted the wait; nothing was taken. Safe to retry after `retry_after`."""

    code = "busy"
    status = 503

    def __init__(self, detail: str, *, retry_after: int = BUSY_RETRY_AFTER) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class LockLost(Busy):
    """The checkout's lock slipped away before its sale was written: the watchdog found it
    gone, or the database refused the lock's fencing token (a later holder has written, so
    this one's lock expired under it: it was paused past its TTL). Nothing was taken."""


class NotWritten(Busy):
    """The database connection was lost while the sale's statement ran, and the database,
    asked again, holds no such order: nothing was sold. Safe to retry."""


class OutcomeUnknown(CheckoutError):
    """The database connection was lost while the sale's statement ran, and the database did
    not answer whether it committed. Not an invitation to retry: `GET /api/orders/<order>`
    tells, once the database is back."""

    code = "outcome_unknown"
    status = 503

    def __init__(self, order: str) -> None:
        super().__init__(
            "the database stopped answering while the sale was written: it may or may not be "
            f"placed; GET /api/orders/{order} tells once the shop's database is back"
        )
        self.order = order


class NotOnSale(CheckoutError):
    code = "not_on_sale"
    status = 409

    def __init__(self, sku: str) -> None:
        super().__init__(f"{sku} has no sale running: start one with `manage.py sale start`")


class NotStarted(CheckoutError):
    code = "not_started"
    status = 409

    def __init__(self, sku: str, opens_at: datetime) -> None:
        super().__init__(f"the sale of {sku} opens at {opens_at.isoformat()}")
        self.opens_at = opens_at
