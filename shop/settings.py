"""flashsale settings: what an operator sets, read from the environment (12-factor).

DATABASE_URL: the database (unset, only the commands that need none run: shop.nodatabase).
Optional: REDIS_URL (default redis://127.0.0.1:6379/0) or
REDIS_CLUSTER_NODES (a Redis Cluster; CELERY_BROKER_URL is then required), CELERY_BROKER_URL
(default REDIS_URL), DJANGO_SECRET_KEY, DJANGO_DEBUG, DJANGO_ALLOWED_HOSTS and the
FLASHSALE_* settings below, every one in docs/configuration.md (a test holds the two equal).
A number is read through `bounded`: out of its bounds, the shop refuses to start. Tuning
constants live in the modules that use them; the tests' and the lab's seams in
shop.lab_settings. `make test|serve|demo` start embedded PostgreSQL and Redis when the first
two are unset.
"""

import secrets
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from shop import queues
from shop.environment import CHECKOUT_DEADLINE_MS, bounded

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
    SECURE_HSTS_SECONDS = bounded("DJANGO_HSTS_SECONDS", 60, 0, 63_072_000)  # two years at most
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
    # Last: the first to see a view's error (a database not answering: 503, not 500).
    "shop.middleware.DatabaseDownMiddleware",
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
DATABASES["default"]["CONN_MAX_AGE"] = bounded("DJANGO_CONN_MAX_AGE", 60, 0, 86_400)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # The same backend, whose health check asks the socket instead of sending `SELECT 1`.
    DATABASES["default"]["ENGINE"] = "shop.postgresql"
# Lets the sale statement be prepared once per connection (inventory.fastpath); Django's own
# queries never are. Turn off behind a pooler in transaction mode that cannot keep them.
if env.bool("DJANGO_DB_PREPARED_STATEMENTS", default=True):
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = 5
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
DATA_UPLOAD_MAX_MEMORY_SIZE = 16 * 1024
# Bearer token for the machine endpoints (the audit): unset, only a staff login reads them.
FLASHSALE_API_TOKEN = env.str("FLASHSALE_API_TOKEN", default="")
# `/metrics` open to any client on this machine, without the token (the local make targets).
FLASHSALE_METRICS_LOOPBACK = env.bool("FLASHSALE_METRICS_LOOPBACK", default=False)

LOGIN_URL = "admin:login"

# --- Redis -------------------------------------------------------------------------------------
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
# Short timeouts so a hung Redis costs a checkout well under a second before the fallback:
# one figure for a command and for a connection, which a hung Redis costs alike.
REDIS_SOCKET_TIMEOUT = bounded("FLASHSALE_REDIS_TIMEOUT", 0.5, 0.01, 10.0)
REDIS_CONNECT_TIMEOUT = REDIS_SOCKET_TIMEOUT
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
CELERY_WORKER_CONCURRENCY = bounded("FLASHSALE_WORKER_CONCURRENCY", 4, 1, 1000)
# The worker's metrics (orders settled, settle lag, task retries) on a port of its own: 0, none.
FLASHSALE_WORKER_METRICS_PORT = bounded("FLASHSALE_WORKER_METRICS_PORT", 0, 0, 65_535)
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
    # How long a delivered, unacknowledged task waits before another worker gets it (Redis):
    # far longer than a batch takes to settle, so a slow worker's batch is not run twice.
    "visibility_timeout": 300,
    # How often a worker looks for such tasks (and puts them back in the queue).
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
    "socket_timeout": 2,
    "socket_connect_timeout": 1,
}
# Beat: the sweeper (orders to expire or publish again) every 10 s, so an order waits seconds
# past its due time; the reconciler, which reads every running sale, once a minute.
CELERY_BEAT_SCHEDULE = {
    "sweep-orders": {"task": "inventory.tasks.sweep_orders_task", "schedule": 10.0},
    "reconcile-sales": {"task": "inventory.tasks.reconcile_sales_task", "schedule": 60.0},
}

# --- flashsale ---------------------------------------------------------------------------------
# Strategy of a sale started without one (`sale start` with no --strategy).
FLASHSALE_DEFAULT_STRATEGY = env.str("FLASHSALE_DEFAULT_STRATEGY", default="lock")
# Every Redis key the shop writes starts with this (tests use their own).
FLASHSALE_REDIS_PREFIX = env.str("FLASHSALE_REDIS_PREFIX", default="flashsale")
# How long GET /api/items/<sku> may answer with what this process read for it a moment ago
# (the item page's poll and a crowd's look at the item; 0: read it every time).
FLASHSALE_ITEM_PAGE_MS = bounded("FLASHSALE_ITEM_PAGE_MS", 500, 0, 60_000)
# How long a checkout may take (milliseconds): past it the buyer is answered `503 busy` and no
# sale of that checkout commits afterwards (a lock or row-lock wait is cut short, a statement
# still waiting is cancelled, units taken are given back).
FLASHSALE_CHECKOUT_DEADLINE_MS = bounded("FLASHSALE_CHECKOUT_DEADLINE_MS", *CHECKOUT_DEADLINE_MS)
# Largest quantity per checkout.
FLASHSALE_MAX_QTY = bounded("FLASHSALE_MAX_QTY", 100, 1, 1_000_000)
# Lock: time to live, and how long a buyer waits for it (never past the checkout's deadline).
# A lock is held for one write, milliseconds: a buyer still waiting after a second is behind a
# stalled holder (a frozen process keeps its locks until their TTL), and its thread is worth
# more to the requests behind it (/healthz among them) than its wait is.
FLASHSALE_LOCK_TTL_MS = bounded("FLASHSALE_LOCK_TTL_MS", 5000, 10, 600_000)
FLASHSALE_LOCK_WAIT_MS = bounded("FLASHSALE_LOCK_WAIT_MS", 1000, 0, 60_000)
# Simulated payment: how long it takes and what share it declines.
FLASHSALE_PAYMENT_LATENCY_MS = bounded("FLASHSALE_PAYMENT_LATENCY_MS", 50, 0, 60_000)
FLASHSALE_PAYMENT_FAILURE_RATE = bounded("FLASHSALE_PAYMENT_FAILURE_RATE", 0.0, 0.0, 1.0)
# Checkout hands its orders to a background publisher, which sends them to the broker as one
# message per this many milliseconds (inventory.publishing); a worker settles each message's
# orders as one batch. 0 publishes every order from the request itself.
FLASHSALE_PUBLISH_INTERVAL_MS = bounded("FLASHSALE_PUBLISH_INTERVAL_MS", 250, 0, 60_000)
# Orders still pending after this many seconds are expired and give their units back.
FLASHSALE_ORDER_HOLD_SECONDS = bounded("FLASHSALE_ORDER_HOLD_SECONDS", 900, 60, 604_800)
# Where load-run batches write their reports (a folder per batch) unless `loadtest --out` names one.
FLASHSALE_REPORTS_DIR = Path(env.str("FLASHSALE_REPORTS_DIR", default=str(BASE_DIR / "reports")))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="WARNING")},
    "loggers": {
        # Sales started, repairs, outages and their end: what an operator reads.
        "inventory": {"level": "INFO"},
        # 409 sold_out is the normal answer of a flash sale, not a warning.
        "django.request": {"level": "ERROR"},
    },
}
