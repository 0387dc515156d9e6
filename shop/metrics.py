"""`/metrics`: the shop's Prometheus metrics (`inventory.metrics`) in the text format, and the
figures read from the database at each scrape (`SalesCollector`).

Every process of a server reports into the directory PROMETHEUS_MULTIPROC_DIR names, when it is
set (prometheus_client's multiprocess mode: a file per process, summed at each scrape), so that
a scrape answered by any gunicorn worker counts what all of them did. gunicorn's master owns
the directory (`shop.gunicorn_conf`): it empties it before the workers start, tells the
library of each worker that exits, and removes a directory it made itself when it stops.
Without the variable, each process counts on its own.

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
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inventory import selectors
from inventory.api import error_response, has_api_token, method_not_allowed


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


def _exposition() -> bytes:
    scraped = CollectorRegistry()
    scraped.register(SalesCollector())
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
