"""Storefront pages: the item list, an item page with a buy form, and an order page."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from inventory import selectors, services
from inventory.exceptions import CheckoutError, InvalidRequest
from inventory.models import Item, Order


def item_list(request: HttpRequest) -> HttpResponse:
    items = Item.objects.select_related("current_sale").filter(current_sale__isnull=False)
    return render(request, "shop/item_list.html", {"items": items})


def _buyer_name(request: HttpRequest) -> str:
    return request.session.get("buyer", "")


def item_page(request: HttpRequest, sku: str) -> HttpResponse:
    try:
        item = selectors.get_item(sku)
    except CheckoutError:
        raise Http404(f"no item {sku}") from None
    error = None
    if request.method == "POST":
        buyer = request.POST.get("buyer", "").strip()
        try:
            qty = int(request.POST.get("qty", ""))
        except ValueError:
            qty = 0
        try:
            if not buyer or len(buyer) > 64:
                raise InvalidRequest("enter your name (at most 64 characters)")
            if not 1 <= qty <= settings.FLASHSALE_MAX_QTY:
                raise InvalidRequest(f"choose a quantity from 1 to {settings.FLASHSALE_MAX_QTY}")
            result = services.place_order(
                sku=item.sku,
                qty=qty,
                buyer=buyer,
                idempotency_key=request.POST.get("idempotency_key") or None,
            )
        except CheckoutError as exc:
            error = exc
        else:
            request.session["buyer"] = buyer
            return redirect("order", order_id=result.order.pk)
    context = {
        "item": item,
        "error": error,
        "buyer": _buyer_name(request),
        "idempotency_key": uuid.uuid4().hex,
        "max_qty": min(settings.FLASHSALE_MAX_QTY, item.per_buyer_limit or 10**9),
    }
    return render(request, "shop/item_page.html", context, status=409 if error else 200)


def order_page(request: HttpRequest, order_id: int) -> HttpResponse:
    try:
        order = selectors.get_order(order_id)
    except Order.DoesNotExist:
        raise Http404(f"no order {order_id}") from None
    return render(request, "shop/order_page.html", {"order": order})
