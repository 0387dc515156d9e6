"""flashsale settings, read from the environment (12-factor).

DATABASE_URL: the database (unset, only the commands that need none run: shop.nodatabase).
Optional: REDIS_URL (default redis://127.0.0.1:6379/0) or
REDIS_CLUSTER_NODES (a Redis Cluster; CELERY_BROKER_URL is then required), CELERY_BROKER_URL
(default REDIS_URL), DJANGO_SECRET_KEY, DJANGO_DEBUG, DJANGO_ALLOWED_HOSTS and the
FLASHSALE_* knobs below. `make test|serve|demo` start embedded PostgreSQL and Redis when the first
two are unset.
"""

import secrets
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from shop import queues

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

DEBUG = env.bool("DJANGO_DEBUG", default=False)
# No public default: the local `make` targets generate a key into .data/ (shop.devservices),
# compose takes it from .env. Without one, commands and Celery workers (which sign nothing
# that outlives them) get a random key of their own, and the web app refuses to start
# (shop/wsgi.py): its sessions and CSRF tokens would be signed with a key anyone can read.
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="")
SECRET_KEY_IS_SET = bool(SECRET_KEY)
if not SECRET_KEY:
    SECRET_KEY = "unset-" + secrets.token_urlsafe(40)
ALLOWED_HOSTS = env.list(
    "DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"]
)
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])
# Served over HTTPS (TLS ending at the proxy, which sets X-Forwarded-Proto): redirect plain
# HTTP, secure-only cookies, HSTS. `manage.py check --deploy` is clean with it on.
HTTPS = env.bool("DJANGO_HTTPS", default=False)
if HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # the proxy's and compose's health checks
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    # As cookiecutter-django does: a short max-age to start with (browsers remember HSTS;
    # raise it once HTTPS is known to work everywhere), subdomains and preload on.
    SECURE_HSTS_SECONDS = env.int("DJANGO_HSTS_SECONDS", default=60)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", default=True)
    SECURE_HSTS_PRELOAD = env.bool("DJANGO_HSTS_PRELOAD", default=True)

INSTALLED_APPS = [
    "shop.admin_site.AdminConfig",  # Django's admin, listing each app's pages with its models
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "inventory",
    "loadtest",
    "pitfalls",
    "shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
# Messages are for staff on the admin's pages, who have a session: kept in it, a request that
# shows none reads nothing. The default (cookie, then session) builds a cookie signer for
# every request, a checkout's too: a sixth of what Django's request cycle costs the API.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

ROOT_URLCONF = "shop.urls"
WSGI_APPLICATION = "shop.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Without DATABASE_URL, commands that need no database still run (`pitfall list`); the first
# use of the database says how to name one (shop.nodatabase), and the web app refuses to start.
DATABASE_URL_IS_SET = bool(env.str("DATABASE_URL", default=""))
if DATABASE_URL_IS_SET:
    DATABASES = {"default": env.db("DATABASE_URL")}
else:
    DATABASES = {"default": {"ENGINE": "shop.nodatabase", "NAME": ""}}
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DJANGO_CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # The same backend, whose health check asks the socket instead of sending `SELECT 1`.
    DATABASES["default"]["ENGINE"] = "shop.postgresql"
# Lets the sale statement be prepared once per connection (inventory.fastpath); Django's own
# queries never are. Turn off behind a pooler in transaction mode that cannot keep them.
if env.bool("DJANGO_DB_PREPARED_STATEMENTS", default=True):
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = 5
# A load run's or benchmark's process sells in a database of its own and records its SaleRun
# rows in the shop's, named here (loadtest.sandbox).
if env.str("FLASHSALE_RUNS_DATABASE_URL", default=""):
    DATABASES["runs"] = {**DATABASES["default"], **env.db("FLASHSALE_RUNS_DATABASE_URL")}
    DATABASE_ROUTERS = ["loadtest.sandbox.RunsRouter"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# Where collectstatic puts files for production (the Docker image sets it); without it, WhiteNoise
# serves them straight from the apps.
STATIC_ROOT = env.str("DJANGO_STATIC_ROOT", default=None)
WHITENOISE_USE_FINDERS = True

# A checkout body is a few dozen bytes; anything near this is abuse.
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("FLASHSALE_MAX_BODY_BYTES", default=16 * 1024)
# Bearer token for the machine endpoints (the audit): unset, only a staff login reads them.
FLASHSALE_API_TOKEN = env.str("FLASHSALE_API_TOKEN", default="")
# `/metrics` open to any client on this machine, without the token (the local make targets).
FLASHSALE_METRICS_LOOPBACK = env.bool("FLASHSALE_METRICS_LOOPBACK", default=False)

LOGIN_URL = "admin:login"

# --- Redis -------------------------------------------------------------------------------------
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
# Short timeouts so a hung Redis costs a checkout well under a second before the fallback.
REDIS_SOCKET_TIMEOUT = env.float("FLASHSALE_REDIS_TIMEOUT", default=0.5)
REDIS_CONNECT_TIMEOUT = env.float("FLASHSALE_REDIS_CONNECT_TIMEOUT", default=0.5)
# A Redis Cluster instead of one Redis: some or all of its nodes, "host:port,host:port"
# (redis-py's RedisCluster finds the rest). Set, it replaces REDIS_URL for the shop's data.
REDIS_CLUSTER_NODES = env.list("REDIS_CLUSTER_NODES", default=[])
# `lock`'s item locks held on a majority of these independent masters (locking.QuorumLock), their
# fences from the database; empty: on the shop's Redis. At least 3, so that one may fail.
REDIS_LOCK_URLS = env.list("REDIS_LOCK_URLS", default=[])
if len(REDIS_LOCK_URLS) in (1, 2):
    raise ImproperlyConfigured(
        f"REDIS_LOCK_URLS lists {len(REDIS_LOCK_URLS)} masters: a quorum lock needs at least 3 "
        "(with 2, either one failing stops every sale); leave it empty for the shop's Redis"
    )

# --- Celery ------------------------------------------------------------------------------------
if REDIS_CLUSTER_NODES and not env.str("CELERY_BROKER_URL", default=""):
    raise ImproperlyConfigured(
        "REDIS_CLUSTER_NODES is set but CELERY_BROKER_URL is not: Celery's Redis transport "
        "cannot use a Redis Cluster. Set CELERY_BROKER_URL to a broker of its own, e.g. "
        "amqp://guest:guest@rabbitmq:5672// or a standalone redis://host:6379/0."
    )
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
# Order tasks are idempotent, so they are acknowledged only once done and redelivered if the
# worker dies: nothing accepted is lost.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Order tasks mostly wait (on payments, on the database), so a worker runs them on threads of
# one process: no process hand-off per task, and one database connection per thread at most.
CELERY_WORKER_POOL = env.str("FLASHSALE_WORKER_POOL", default="threads")
CELERY_WORKER_CONCURRENCY = env.int("FLASHSALE_WORKER_CONCURRENCY", default=4)
# The worker's metrics (orders settled, settle lag, task retries) on a port of its own: 0, none.
FLASHSALE_WORKER_METRICS_PORT = env.int("FLASHSALE_WORKER_METRICS_PORT", default=0)
FLASHSALE_WORKER_METRICS_HOST = env.str("FLASHSALE_WORKER_METRICS_HOST", default="127.0.0.1")
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = env.str("FLASHSALE_TASK_QUEUE", default="flashsale")
# Orders, give-back and maintenance tasks each on a queue of their own (shop.queues).
CELERY_TASK_QUEUES = queues.declarations(CELERY_TASK_DEFAULT_QUEUE)
CELERY_TASK_ROUTES = queues.routes(CELERY_TASK_DEFAULT_QUEUE)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes the database connection around every task unless this is set;
# `shop.celery` instead closes it the way Django does after a request (CONN_MAX_AGE, errors),
# so a worker does not open a connection per order.
CELERY_DB_REUSE_MAX = 2**62
CELERY_BROKER_CONNECTION_TIMEOUT = 1
# A checkout must not wait on a broker that is down: publish once, the sweeper does the rest.
CELERY_TASK_PUBLISH_RETRY = False
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # How long a delivered, unacknowledged task waits before another worker gets it (Redis).
    "visibility_timeout": env.int("FLASHSALE_BROKER_VISIBILITY_TIMEOUT", default=300),
    # How often a worker looks for such tasks (and puts them back in the queue).
    "unacked_restore_interval": env.int("FLASHSALE_BROKER_RESTORE_SECONDS", default=10),
    "unacked_restore_throttle": 1,
    "socket_timeout": 2,
    "socket_connect_timeout": 1,
}
CELERY_BEAT_SCHEDULE = {
    "sweep-orders": {
        "task": "inventory.tasks.sweep_orders_task",
        "schedule": env.float("FLASHSALE_SWEEP_SECONDS", default=10.0),
    },
    "reconcile-sales": {
        "task": "inventory.tasks.reconcile_sales_task",
        "schedule": env.float("FLASHSALE_RECONCILE_SECONDS", default=60.0),
    },
}

# --- flashsale ---------------------------------------------------------------------------------
FLASHSALE_DEFAULT_STRATEGY = env.str("FLASHSALE_DEFAULT_STRATEGY", default="lock")
FLASHSALE_STRATEGIES = {
    "lock": "inventory.strategies.lock.LockStrategy",
    "segmented": "inventory.strategies.segmented.SegmentedStrategy",
    "lua": "inventory.strategies.lua.LuaStrategy",
    "optimistic": "inventory.strategies.optimistic.OptimisticStrategy",
    "unsafe": "inventory.strategies.unsafe.UnsafeStrategy",
}
# Every Redis key the shop writes starts with this (tests use their own).
FLASHSALE_REDIS_PREFIX = env.str("FLASHSALE_REDIS_PREFIX", default="flashsale")
# Stock rows per sale: `segmented`'s shards (each with its own lock) and `lua`'s stripes.
FLASHSALE_SHARDS = env.int("FLASHSALE_SHARDS", default=10)
FLASHSALE_STRIPES = env.int("FLASHSALE_STRIPES", default=10)
for _rows in ("FLASHSALE_SHARDS", "FLASHSALE_STRIPES"):
    if not 1 <= globals()[_rows] <= 1000:
        raise ImproperlyConfigured(f"{_rows} must be from 1 to 1000, not {globals()[_rows]}")
# How long a checkout may use an item read by an earlier one (strategies that allow it).
FLASHSALE_ITEM_MEMORY_MS = env.int("FLASHSALE_ITEM_MEMORY_MS", default=1000)
# How long GET /api/items/<sku> may answer with what this process read for it a moment ago
# (the item page's poll and a crowd's look at the item; 0: read it every time).
FLASHSALE_ITEM_PAGE_MS = env.int("FLASHSALE_ITEM_PAGE_MS", default=500)
if not 0 <= FLASHSALE_ITEM_PAGE_MS <= 60_000:
    raise ImproperlyConfigured(
        f"FLASHSALE_ITEM_PAGE_MS must be from 0 to 60000 (a minute), not {FLASHSALE_ITEM_PAGE_MS}"
    )
# How long a checkout may take (milliseconds): past it the buyer is answered `503 busy` and no
# sale of that checkout commits afterwards (a lock or row-lock wait is cut short, a statement
# still waiting is cancelled, units taken are given back).
FLASHSALE_CHECKOUT_DEADLINE_MS = env.int("FLASHSALE_CHECKOUT_DEADLINE_MS", default=3000)
if not 100 <= FLASHSALE_CHECKOUT_DEADLINE_MS <= 60_000:
    raise ImproperlyConfigured(
        "FLASHSALE_CHECKOUT_DEADLINE_MS must be from 100 to 60000 (a minute), not "
        f"{FLASHSALE_CHECKOUT_DEADLINE_MS}"
    )
FLASHSALE_MAX_QTY = env.int("FLASHSALE_MAX_QTY", default=100)
# Lock: time to live, how long a buyer waits for it, and whether a watchdog renews it.
FLASHSALE_LOCK_TTL_MS = env.int("FLASHSALE_LOCK_TTL_MS", default=5000)
FLASHSALE_LOCK_WAIT_MS = env.int("FLASHSALE_LOCK_WAIT_MS", default=5000)
FLASHSALE_LOCK_WATCHDOG = env.bool("FLASHSALE_LOCK_WATCHDOG", default=True)
# What builds the strategies' locks (a dotted path; `locking.Lock`, ours, by default): the seam
# through which the benchmark runs `lock` with a peer's lock (inventory.strategies.locks).
FLASHSALE_LOCK_FACTORY = env.str("FLASHSALE_LOCK_FACTORY", default="locking.Lock")
# On: a process's lock waiters wait through one wake-up channel (locking.wakes: one list, one
# connection), so its connections do not grow with its waiters (threaded or gevent workers).
# Off (the default): each waiter blocks in BLPOP on a connection of its own, which a sync
# worker, one checkout at a time, pays no more for, and which hands over faster.
FLASHSALE_LOCK_WAKE_HUB = env.bool("FLASHSALE_LOCK_WAKE_HUB", default=False)
if FLASHSALE_LOCK_WAKE_HUB and REDIS_CLUSTER_NODES:
    raise ImproperlyConfigured(
        "FLASHSALE_LOCK_WAKE_HUB cannot be used with REDIS_CLUSTER_NODES: a release pushes the "
        "hand-over onto the hub's one list, which lives in one slot, while the locks live in many"
    )
# Optimistic: how many version-checked attempts before answering busy.
FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS = env.int("FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS", default=20)
# ...after which one attempt queues for the item's row lock, at most this long (ms).
FLASHSALE_ROW_LOCK_TIMEOUT_MS = env.int("FLASHSALE_ROW_LOCK_TIMEOUT_MS", default=3000)
# Circuit breaker: how often a process probes Redis while it is down.
FLASHSALE_BREAKER_PROBE_SECONDS = env.float("FLASHSALE_BREAKER_PROBE_SECONDS", default=1.0)
# Celery broker breaker: how often a process retries publishing while the broker is down.
FLASHSALE_BROKER_PROBE_SECONDS = env.float("FLASHSALE_BROKER_PROBE_SECONDS", default=5.0)
# Simulated payment: how long it takes and how often it is declined (0.0 to 1.0).
FLASHSALE_PAYMENT_LATENCY_MS = env.int("FLASHSALE_PAYMENT_LATENCY_MS", default=50)
FLASHSALE_PAYMENT_FAILURE_RATE = env.float("FLASHSALE_PAYMENT_FAILURE_RATE", default=0.0)
# How many payments of one batch a worker process waits on at once (threads; no database
# connection each: the batch's one transaction records them).
FLASHSALE_PAYMENT_CONCURRENCY = env.int("FLASHSALE_PAYMENT_CONCURRENCY", default=128)
# Checkout hands its orders to a background publisher, which sends them to the broker as one
# message per this many milliseconds (at most FLASHSALE_PUBLISH_BATCH orders each); a worker
# settles each message's orders as one batch. 0 publishes every order from the request itself.
FLASHSALE_PUBLISH_INTERVAL_MS = env.int("FLASHSALE_PUBLISH_INTERVAL_MS", default=250)
FLASHSALE_PUBLISH_BATCH = env.int("FLASHSALE_PUBLISH_BATCH", default=200)
# Orders still pending after this many seconds are expired and give their units back.
FLASHSALE_ORDER_HOLD_SECONDS = env.int("FLASHSALE_ORDER_HOLD_SECONDS", default=900)
# Orders still pending (or paid, unconfirmed) after this many seconds are enqueued again.
FLASHSALE_REQUEUE_AFTER_SECONDS = env.int("FLASHSALE_REQUEUE_AFTER_SECONDS", default=30)
# Seconds a client is told to wait after `503 busy`.
FLASHSALE_BUSY_RETRY_AFTER = env.int("FLASHSALE_BUSY_RETRY_AFTER", default=1)
# Where load-run batches write their reports (a folder per batch) unless `loadtest --out` names one.
FLASHSALE_REPORTS_DIR = Path(env.str("FLASHSALE_REPORTS_DIR", default=str(BASE_DIR / "reports")))
# Simulated work inside each critical section (ms); for demonstrating lock expiry and races.
FLASHSALE_HOLD_DELAY_MS = env.int("FLASHSALE_HOLD_DELAY_MS", default=0)
# Delay between the read and the write of `unsafe` (ms): widens its race window.
FLASHSALE_UNSAFE_DELAY_MS = env.int("FLASHSALE_UNSAFE_DELAY_MS", default=0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="WARNING")},
    "loggers": {
        "inventory": {"level": env.str("FLASHSALE_LOG_LEVEL", default="INFO")},
        # 409 sold_out is the normal answer of a flash sale, not a warning.
        "django.request": {"level": "ERROR"},
    },
}
