"""`/metrics`: the shop's Prometheus metrics (`inventory.metrics`) in the text format, and the
figures read from the database at each scrape (`SalesCollector`).

Every process of a server reports into the directory PROMETHEUS_MULTIPROC_DIR names, when it is
set (prometheus_client's multiprocess mode: a file per process, summed at each scrape), so that
a scrape answered by any gunicorn worker counts what all of them did. gunicorn's master owns
the directory (`shop.gunicorn_conf`): it empties it before the workers start, tells the
library of each worker that exits, and removes a directory it made itself when it stops.
Without the variable, each process counts on its own.

Where the web processes hand checkouts to a sale writer (FLASHSALE_SALE_WRITER), they count
those only as `handed_off`; what the writer answered them, and how long they took, it counts
itself, and each scrape reads that from it (`SaleWriterCollector`), with its sales, batches
and shard locks.

Who may read it: a client sending the bearer token FLASHSALE_API_TOKEN, or, where
FLASHSALE_METRICS_LOOPBACK is on (the local `make serve` and load runs turn it on), any client
on this machine.

"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from inventory import selectors
from inventory.api import error_response, has_api_token, method_not_allowed
from inventory.writer import writer_stats


def _registry() -> CollectorRegistry:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


class SalesCollector(Collector):
    """Figures read from the database at each scrape, whichever process wrote them: units
    oversold per item on sale (must stay 0), and those sales' orders by status."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        oversold, by_status = selectors.sales_figures()
        units = GaugeMetricFamily(
            "flashsale_oversold_units",
            "Units accepted beyond the supply of each item's current sale (must stay 0).",
            labels=["sku"],
        )
        for sku, count in oversold.items():
            units.add_metric([sku], count)
        orders = GaugeMetricFamily(
            "flashsale_orders",
            "Orders of each item's current sale, by status.",
            labels=["sku", "status"],
        )
        for sku, counts in by_status.items():
            for status, count in counts.items():
                orders.add_metric([sku, str(status)], count)
        yield units
        yield orders


#: How long a scrape waits for the sale writer's figures.
WRITER_TIMEOUT = 1.0

#: The writer's counts shown as counters: (metric, its stats' key, help).
_WRITER_COUNTS = (
    ("flashsale_sale_writer_sales", "sales", "Sales the sale writer committed."),
    ("flashsale_sale_writer_batches", "batches", "Statements (batches) the sale writer sent."),
    (
        "flashsale_sale_writer_shard_locks",
        "locked",
        "Shard locks the sale writer took for handed-off segmented checkouts.",
    ),
    (
        "flashsale_sale_writer_lock_waits",
        "lock_waits",
        "Handed-off segmented checkouts that waited in the writer for a shard's lock.",
    ),
)


class SaleWriterCollector(Collector):
    """This host's sale writer's figures, read from it at each scrape (`writer.writer_stats`):
    whether it answered, the handed-off checkouts it answered by strategy and outcome, their
    times from their start in the web process to the writer's answer, its sales, batches and
    shard locks. Its counts start again from 0 when it restarts, as a process's counters do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "flashsale_sale_writer_up",
            "1 when the sale writer (FLASHSALE_SALE_WRITER) answered this scrape, else 0.",
        )
        try:
            stats = writer_stats(self.path, timeout=WRITER_TIMEOUT)
            checkouts = stats["checkouts"]
        except (OSError, ValueError, KeyError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        answered = CounterMetricFamily(
            "flashsale_sale_writer_checkouts",
            "Handed-off checkouts the sale writer answered, by the item's strategy and the "
            "outcome (the web processes count them as `handed_off`).",
            labels=["strategy", "outcome"],
        )
        for strategy, outcome, count in checkouts["outcomes"]:
            answered.add_metric([strategy, outcome], count)
        yield answered
        seconds = HistogramMetricFamily(
            "flashsale_sale_writer_checkout_duration_seconds",
            "Time from a handed-off checkout's arrival in its web process to the sale "
            "writer's answer, by the item's strategy.",
            labels=["strategy"],
        )
        for strategy, histogram in checkouts["seconds"].items():
            buckets = [(str(bound), count) for bound, count in histogram["buckets"]]
            seconds.add_metric([strategy], buckets, sum_value=histogram["sum"])
        yield seconds
        for name, key, text in _WRITER_COUNTS:
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], stats[key])
            yield counter


def _exposition() -> bytes:
    scraped = CollectorRegistry()
    scraped.register(SalesCollector())
    if settings.FLASHSALE_SALE_WRITER:
        scraped.register(SaleWriterCollector(settings.FLASHSALE_SALE_WRITER))
    return generate_latest(_registry()) + generate_latest(scraped)


def _on_loopback(request: HttpRequest) -> bool:
    try:
        return ipaddress.ip_address(request.META.get("REMOTE_ADDR", "")).is_loopback
    except ValueError:
        return False


@csrf_exempt  # it changes nothing: any other method is a plain 405
def metrics(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    open_here = settings.FLASHSALE_METRICS_LOOPBACK and _on_loopback(request)
    if not (open_here or has_api_token(request)):
        return error_response(
            "unauthorized",
            "the metrics are for a client sending the bearer token FLASHSALE_API_TOKEN "
            "(Authorization: Bearer ...)",
            401,
            {"WWW-Authenticate": 'Bearer realm="flashsale"'},
        )
    return HttpResponse(_exposition(), content_type=CONTENT_TYPE_LATEST)
