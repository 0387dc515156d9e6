from django.urls import path

from . import api

urlpatterns = [
    path("items", api.item_list, name="api-items"),
    path("items/<str:sku>", api.item_detail, name="api-item"),
    path("items/<str:sku>/audit", api.item_audit, name="api-item-audit"),
    path("noop", api.noop, name="api-noop"),
    path("checkout", api.checkout, name="api-checkout"),
    # An order's public id (a UUID): anything else is not an order's (404).
    path("orders/<uuid:order_id>", api.order_detail, name="api-order"),
]
