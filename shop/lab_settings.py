"""Settings of the processes that the tests, the benchmarks, the load runs and the pitfall lab
start (servers, Celery workers, beat, buyer processes): the shop's own settings, plus seams that
those processes read from their environment. No operator sets these.

A seam is a Django setting here only when the environment names it; unset, the code's own value
applies (each is read as `getattr(settings, NAME, <the code's value>)`), so a process under these
settings behaves as the shop does until a seam is set. A test in the tests' own process sets the
same names on `settings`, or a module's constant with monkeypatch. See docs/lab.md#seams.
"""

import os

from shop.settings import *  # noqa: F403
from shop.settings import CELERY_BEAT_SCHEDULE, CELERY_BROKER_TRANSPORT_OPTIONS, DATABASES, env

_SEAMS = {
    # Simulated work inside each critical section (ms): makes races and lock expiry visible.
    "FLASHSALE_HOLD_DELAY_MS": env.int,
    # Delay between `unsafe`'s read and its write (ms): widens its race.
    "FLASHSALE_UNSAFE_DELAY_MS": env.int,
    # What builds `lock`'s item lock (a dotted path): the benchmark's peer locks, the lab's.
    "FLASHSALE_LOCK_FACTORY": env.str,
    # Off: nothing renews a lock, which then expires under a holder that works past its TTL.
    "FLASHSALE_LOCK_WATCHDOG": env.bool,
    # Shorter intervals, so that a test sees a repair, a retry or a requeue within seconds.
    "FLASHSALE_BREAKER_PROBE_SECONDS": env.float,
    "FLASHSALE_BROKER_PROBE_SECONDS": env.float,
    "FLASHSALE_REQUEUE_AFTER_SECONDS": env.int,
    "FLASHSALE_PAYMENT_CONCURRENCY": env.int,
}
for _name, _read in _SEAMS.items():
    if _name in os.environ:
        globals()[_name] = _read(_name)

# Redis broker: when a dead worker's task is handed out again, and how often workers look.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    **CELERY_BROKER_TRANSPORT_OPTIONS,
    "visibility_timeout": env.int(
        "FLASHSALE_BROKER_VISIBILITY_TIMEOUT",
        default=CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"],
    ),
    "unacked_restore_interval": env.int(
        "FLASHSALE_BROKER_RESTORE_SECONDS",
        default=CELERY_BROKER_TRANSPORT_OPTIONS["unacked_restore_interval"],
    ),
}
# Beat's sweeper and reconciler, due sooner.
CELERY_BEAT_SCHEDULE = {
    "sweep-orders": {
        **CELERY_BEAT_SCHEDULE["sweep-orders"],
        "schedule": env.float(
            "FLASHSALE_SWEEP_SECONDS", default=CELERY_BEAT_SCHEDULE["sweep-orders"]["schedule"]
        ),
    },
    "reconcile-sales": {
        **CELERY_BEAT_SCHEDULE["reconcile-sales"],
        "schedule": env.float(
            "FLASHSALE_RECONCILE_SECONDS",
            default=CELERY_BEAT_SCHEDULE["reconcile-sales"]["schedule"],
        ),
    },
}

# A load run's or benchmark's process sells in a database of its own and records its SaleRun
# rows in the shop's, named here (loadtest.sandbox).
if env.str("FLASHSALE_RUNS_DATABASE_URL", default=""):
    DATABASES["runs"] = {**DATABASES["default"], **env.db("FLASHSALE_RUNS_DATABASE_URL")}
    DATABASE_ROUTERS = ["loadtest.sandbox.RunsRouter"]
