from django.urls import path, re_path

from . import api

urlpatterns = [
    # What a flash crowd asks for most first (patterns are tried in order, none overlaps).
    path("checkout", api.checkout, name="api-checkout"),
    path("items/<str:sku>", api.item_detail, name="api-item"),
    path("noop", api.noop, name="api-noop"),
    path("items", api.item_list, name="api-items"),
    path("items/<str:sku>/audit", api.item_audit, name="api-item-audit"),
    # An order's public id (a UUID): anything else is no order's (404, JSON).
    path("orders/<str:order_id>", api.order_detail, name="api-order"),
    # Last: every other path under /api/ answers a JSON 404, not the pages' HTML one.
    re_path(r"", api.not_found, name="api-not-found"),
]
