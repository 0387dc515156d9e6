"""Storefront pages: the item list, an item page with a buy form, and an order page.

The pages render what is true at request time; shop/static/shop/shop.js keeps them current by
polling the JSON API (stock, sale opening, order status) and /healthz (the Redis fallback).
"""

from __future__ import annotations

import uuid
from uuid import UUID

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.templatetags.static import static
from django.views import defaults
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods

from inventory import api, selectors, services
from inventory.exceptions import Busy, CheckoutError, InvalidRequest
from inventory.metrics import CheckoutOutcome
from inventory.models import LIVE_STATUSES, BuyerAllowance, Item, Order, OrderStatus

#: Statuses after which an order page stops polling.
FINAL_STATUSES = (OrderStatus.CONFIRMED, OrderStatus.FAILED, OrderStatus.EXPIRED)


@require_GET
def item_list(request: HttpRequest) -> HttpResponse:
    items = selectors.items_on_sale()
    now = selectors.database_now()  # the clock sales open by; the page's script corrects for
    return render(request, "shop/item_list.html", {"items": items, "now": now})


def _buyer_name(request: HttpRequest) -> str:
    return request.session.get("buyer", "")


def _units_held(item: Item, buyer: str) -> int:
    """Units buyer holds of item, as counted against its per-buyer limit (0 without a limit)."""
    if (
        not buyer
        or item.per_buyer_limit is None
        or item.current_sale_id is None
        or not buyer.isprintable()
    ):
        return 0
    allowance = BuyerAllowance.objects.filter(sale_id=item.current_sale_id, buyer=buyer).first()
    return allowance.units if allowance else 0


def _parse_order_form(request: HttpRequest) -> tuple[str, int]:
    """The buyer's name and quantity from the buy form; InvalidRequest says what is wrong."""
    buyer = request.POST.get("buyer", "").strip()
    if not buyer or len(buyer) > 64 or not buyer.isprintable():
        raise InvalidRequest("enter your name (at most 64 characters)")
    try:
        qty = int(request.POST.get("qty", ""))
    except ValueError:
        qty = 0
    if not 1 <= qty <= settings.FLASHSALE_MAX_QTY:
        raise InvalidRequest(f"choose a quantity from 1 to {settings.FLASHSALE_MAX_QTY}")
    return buyer, qty


def _form_key(request: HttpRequest) -> str | None:
    """The form's idempotency key (the page renders a uuid4 hex); InvalidRequest if tampered."""
    key = request.POST.get("idempotency_key") or None
    if key is not None and (len(key) > 128 or not key.isprintable()):
        raise InvalidRequest("the form is out of date: reload the page and try again")
    return key


@never_cache  # a page from the back button would resubmit an old idempotency key
@require_http_methods(["GET", "POST"])
def item_page(request: HttpRequest, sku: str) -> HttpResponse:
    try:
        item = selectors.get_item(sku)
    except CheckoutError:
        raise Http404(f"no item {sku}") from None
    error: CheckoutError | None = None
    buyer = _buyer_name(request)
    qty = 1
    if request.method == "POST":
        # The form shows the name it was sent with, not a remembered one it may complain about.
        buyer = request.POST.get("buyer", "").strip()[:64]
        with services.counted_checkout() as counted:  # as the API's checkouts are
            try:
                buyer, qty = _parse_order_form(request)
                result = services.place_order(
                    sku=item.sku,
                    qty=qty,
                    buyer=buyer,
                    # One key per rendered form: a double submit gets the first order back.
                    idempotency_key=_form_key(request),
                )
            except CheckoutError as exc:
                error, counted.outcome = exc, exc.code
            else:
                counted.outcome = CheckoutOutcome.ACCEPTED
        if error is None:
            request.session["buyer"] = buyer
            return redirect("order", order_id=result.order.public_id)
        if buyer and len(buyer) <= 64 and buyer.isprintable():
            request.session["buyer"] = buyer
        item = selectors.get_item(item.sku)
    limit = item.per_buyer_limit
    held = _units_held(item, buyer)
    limit_left = None if limit is None else max(0, limit - held)
    max_qty = settings.FLASHSALE_MAX_QTY if limit_left is None else max(1, limit_left)
    sale = item.current_sale
    now = selectors.database_now()
    # Reached only when the buyer holds all one buyer may: asking for more than the limit
    # allows (`LimitReached` for a buyer who holds fewer) leaves the form usable.
    limit_reached = limit_left == 0
    not_started = sale is not None and sale.opens_at > now
    if sale is None:
        phase = "not_on_sale"
    elif not_started:
        phase = "not_started"
    elif not item.units_left:
        phase = "sold_out"
    elif limit_reached:
        phase = "limit_reached"
    else:
        phase = "on_sale"
    context = {
        "item": item,
        "sale": sale,
        "error": error,
        "error_code": error.code if error else "",
        "buyer": buyer,
        "asked": qty,
        "qty": min(max(qty, 1), max_qty),
        "held": held,
        "limit_left": limit_left,
        "limit_reached": limit_reached,
        "not_started": not_started,
        "phase": phase,
        # A quantity is offered while the item is or will be on sale for this buyer.
        "offers_quantity": phase in ("on_sale", "not_started"),
        "now": now,
        "idempotency_key": uuid.uuid4().hex,
        "max_qty": max_qty,
    }
    # A form re-rendered with its error is a 200, Django's convention (a 4xx would be logged
    # by the browser as a failed load); only "busy, retry later" keeps its 503.
    status = 200
    headers = {}
    if isinstance(error, Busy):
        status = 503
        headers["Retry-After"] = str(error.retry_after)
    response = render(request, "shop/item_page.html", context, status=status)
    for name, value in headers.items():
        response[name] = value
    return response


@require_GET
def order_page(request: HttpRequest, order_id: UUID) -> HttpResponse:
    try:
        order = selectors.get_order(order_id)
    except Order.DoesNotExist:
        raise Http404(f"no order {order_id}") from None
    context = {
        "order": order,
        "final": order.status in FINAL_STATUSES,
        "live": order.status in LIVE_STATUSES,
    }
    return render(request, "shop/order_page.html", context)


@require_GET
def favicon(request: HttpRequest) -> HttpResponse:
    """/favicon.ico, which browsers ask for on pages that name no icon (the admin's)."""
    return redirect(static("shop/favicon.svg"), permanent=True)


def for_the_api(request: HttpRequest) -> bool:
    return request.path.startswith("/api/")


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 400 page (a request it refused before any view: a bad Host header, say); under
    /api/, the API's JSON error."""
    if for_the_api(request):
        # (what was wrong is logged; its text may name the server's settings)
        detail = "the request was refused before it reached the API (a Host it does not serve?)"
        return api.error_response("invalid", detail, 400)
    return defaults.bad_request(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500 page (a view failed unexpectedly); under /api/, the API's JSON error."""
    if for_the_api(request):
        detail = "the server failed to answer this request (its log says why); try again"
        return api.error_response("error", detail, 500)
    return defaults.server_error(request)
