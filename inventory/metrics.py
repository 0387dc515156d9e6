"""The shop's Prometheus metrics: checkouts, the strategies' locks, the database fallback and
the breakers (the web workers': `shop.metrics` exposes them at `/metrics`), orders settled and
task retries (the Celery worker's: on its own port, `shop.celery`).

Label values are few: `strategy` is an item's strategy (`none` for an unknown item), `outcome`
a `CheckoutOutcome` (for a renewal: `renewed` or `failed`), `how` a lock was lost `watchdog` or
`fenced`, `breaker` `redis` or `broker`.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from prometheus_client import Counter, Gauge, Histogram


class CheckoutOutcome(StrEnum):
    """How a checkout was answered, as the `outcome` label says it: accepted (201), or the API's
    error code; any other answer (an unexpected error, a body too large) is `error`."""

    ACCEPTED = "accepted"
    SOLD_OUT = "sold_out"
    LIMIT_REACHED = "limit_reached"
    BUSY = "busy"
    OUTCOME_UNKNOWN = "outcome_unknown"
    INVALID = "invalid"
    UNKNOWN_SKU = "unknown_sku"
    NOT_ON_SALE = "not_on_sale"
    NOT_STARTED = "not_started"
    ERROR = "error"


_OUTCOMES = frozenset(CheckoutOutcome)

CHECKOUTS = Counter(
    "flashsale_checkouts",
    "Checkouts answered, by the item's strategy and the outcome.",
    ["strategy", "outcome"],
)
#: From a millisecond to five seconds (the longest a checkout waits for a lock, by default).
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CHECKOUT_SECONDS = Histogram(
    "flashsale_checkout_duration_seconds",
    "Time from a checkout's arrival to its answer, by the item's strategy.",
    ["strategy"],
    buckets=SECONDS,
)
LOCK_WAIT = Histogram(
    "flashsale_lock_wait_seconds",
    "Time a checkout waited for a lock it then held (lock, segmented).",
    ["strategy"],
    buckets=SECONDS,
)
LOCK_HOLD = Histogram(
    "flashsale_lock_hold_seconds",
    "Time a checkout held a lock, from its grant to its release.",
    ["strategy"],
    buckets=SECONDS,
)
LOCK_TIMEOUTS = Counter(
    "flashsale_lock_acquire_timeouts",
    "Waits for a lock that ended without it (the checkout answers busy or tries elsewhere).",
    ["strategy"],
)
LOCKS_LOST = Counter(
    "flashsale_locks_lost",
    "Locks that slipped away from their holder before its write: the watchdog found them "
    "gone, or the database refused the holder's fencing token.",
    ["strategy", "how"],
)
WATCHDOG_RENEWALS = Counter(
    "flashsale_lock_renewals",
    "Watchdog renewals of held locks: `renewed`, or `failed` (the lock is taken for lost).",
    ["strategy", "outcome"],
)
FALLBACK_CHECKOUTS = Counter(
    "flashsale_fallback_checkouts",
    "Checkouts of a Redis strategy served by the database fallback while Redis was down.",
    ["strategy"],
)
BREAKER_OPEN = Gauge(
    "flashsale_breaker_open",
    "1 while a process's breaker is open (its dependency unreachable), of any live process.",
    ["breaker"],
    multiprocess_mode="livemax",
)


#: The `strategy` of a checkout for no item on sale (an unknown sku, a request that is invalid).
NO_STRATEGY = "none"


def export_before_use(
    *, breakers: Iterable[str], redis_strategies: Iterable[str], lock_strategies: Iterable[str]
) -> None:
    """Export, at 0, every series an operator alerts on before its first event (a breaker open,
    a fallback checkout, a lock lost, a renewal, a reconciler repair): a dashboard or an alert
    then reads 0, not "no data". Called as each process starts (`InventoryConfig.ready`).

    Each series is written, not only created (`inc(0)`): in multiprocess mode that is what puts
    it in this process's own file, also in a process forked from one that made it."""
    counters = [FALLBACK_CHECKOUTS.labels(strategy) for strategy in redis_strategies]
    for strategy in lock_strategies:
        counters += [LOCKS_LOST.labels(strategy, how) for how in ("watchdog", "fenced")]
        counters += [WATCHDOG_RENEWALS.labels(strategy, done) for done in ("renewed", "failed")]
    for store in ("redis", "database"):
        counters += [RECONCILER_REPAIRS.labels(store), RECONCILER_DRIFT_UNITS.labels(store)]
    for counter in counters:
        counter.inc(0)
    for name in breakers:
        BREAKER_OPEN.labels(name).set(0)


def checkout_answered(strategy: str, outcome: str, seconds: float) -> None:
    """Count a checkout answered with `outcome` (a `CheckoutOutcome`, or an error code that is
    none: counted `error`)."""
    label = outcome if outcome in _OUTCOMES else CheckoutOutcome.ERROR
    CHECKOUTS.labels(strategy, label).inc()
    CHECKOUT_SECONDS.labels(strategy).observe(seconds)


ORDERS_SETTLED = Counter(
    "flashsale_orders_settled",
    "Orders a worker moved to a final status: `confirmed` (paid) or `failed` (declined).",
    ["outcome"],
)
SETTLE_LAG = Histogram(
    "flashsale_settle_lag_seconds",
    "Time from an order's 201 (its row written) to its final status, per order settled.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
TASK_RETRIES = Counter(
    "flashsale_task_retries",
    "Celery tasks retried (the database or Redis briefly away), by task.",
    ["task"],
)
RECONCILER_REPAIRS = Counter(
    "flashsale_reconciler_repairs",
    "Drift the reconciler found and repaired, by store: `redis` (counters rebuilt from the "
    "database) or `database` (stock rows set from the orders).",
    ["store"],
)
RECONCILER_DRIFT_UNITS = Counter(
    "flashsale_reconciler_drift_units",
    "Units by which a store the reconciler repaired was off (Redis counters that were missing "
    "are repaired but not counted here).",
    ["store"],
)
