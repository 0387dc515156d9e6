"""A request that meets a database that is not answering is answered `503` with `Retry-After`,
not Django's `500`: the API's JSON `busy` under /api/, a page saying so elsewhere.

The checkout answers its own database errors (`inventory.services.place_order`: `503 busy`, or
`503 outcome_unknown` when a sale's commit could not be looked up). This covers what reads the
database around it: the item page before and after its buy form's checkout, an order's page,
`GET /api/items/<sku>`, `GET /api/orders/<id>`. The middleware is last in MIDDLEWARE, so that
its `process_exception` is the first to see a view's error.
"""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from inventory import api
from inventory.exceptions import BUSY_RETRY_AFTER
from inventory.services import DATABASE_DOWN_ERRORS
from shop.views import for_the_api

logger = logging.getLogger(__name__)


class DatabaseDownMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, DATABASE_DOWN_ERRORS):
            return None  # Django's own handling: a 500
        logger.warning(
            "%s %s: the database is not answering (%s)",
            request.method,
            request.path,
            exception.__class__.__name__,
        )
        response: HttpResponse
        if for_the_api(request):
            detail = "the shop's database is not answering; try again in a moment"
            response = api.error_response("busy", detail, 503)
        else:
            response = render(request, "shop/unavailable.html", status=503)
        response["Retry-After"] = str(BUSY_RETRY_AFTER)
        return response
