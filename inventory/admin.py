"""The admin: items, their sales and orders. Staff only (load runs: `loadtest.admin`).

Stock, strategy and per-buyer limit are shown, not edited: they belong to a sale, whose Redis
counters, shards and buyer allowances `manage.py sale start` keeps consistent; an edit here would
bypass all three. Orders move only through their lifecycle (workers, sweeper), and sales and
load runs are records, so those are read-only too.
"""

from __future__ import annotations

from typing import cast

from django.contrib import admin
from django.http import HttpRequest

from .models import Item, ItemQuerySet, Order, Sale, StockShard


def strategy_column(field: str, description: str | None = None):
    """A list column with a strategy's name as the CLI and API spell it (not its long label)."""

    @admin.display(description=description or field, ordering=field)
    def column(self, obj) -> str:
        return getattr(obj, field)

    return column


class ReadOnlyAdminMixin:
    """View-only: nothing is added, changed or deleted through the admin."""

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


_SHARD_FIELDS = ("sale", "index", "stock", "version")

#: What the item page shows; only the display fields (sku, name, price) are editable: stock,
#: strategy and limit change through `sale start`, which keeps shards, Redis and allowances in
#: step.
_ITEM_FIELDS = (
    "sku",
    "name",
    "price",
    "strategy",
    "units_left",
    "stock",
    "per_buyer_limit",
    "shard_count",
    "version",
    "current_sale",
    "created_at",
)


class StockShardInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = StockShard
    extra = 0
    fields = _SHARD_FIELDS
    readonly_fields = _SHARD_FIELDS
    can_delete = False


@admin.register(Item)
class ItemAdmin(admin.ModelAdmin):
    list_display = [
        "sku",
        "name",
        "price",
        "units_left",
        "strategy_name",
        "per_buyer_limit",
        "shard_count",
        "opens_at",
    ]
    list_filter = ["strategy"]
    search_fields = ["sku", "name"]
    list_select_related = ["current_sale"]
    fields = _ITEM_FIELDS
    readonly_fields = [name for name in _ITEM_FIELDS if name not in ("sku", "name", "price")]

    def get_queryset(self, request: HttpRequest) -> ItemQuerySet:
        return cast(ItemQuerySet, super().get_queryset(request)).with_units_left()

    @admin.display(description="units left", ordering="derived_units_left")
    def units_left(self, item: Item) -> int:
        return item.units_left

    inlines = [StockShardInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Item | None = None) -> list[str]:
        # The sku names the item in Redis keys, the API and orders: fixed once created.
        return [*self.readonly_fields, "sku"] if obj else list(self.readonly_fields)

    strategy_name = strategy_column("strategy")

    @admin.display(description="opens at", ordering="current_sale__opens_at")
    def opens_at(self, item: Item):
        return item.current_sale.opens_at if item.current_sale else None


@admin.register(Sale)
class SaleAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "pk",
        "item",
        "initial_stock",
        "added_stock",
        "strategy_name",
        "per_buyer_limit",
        "started_at",
        "opens_at",
    ]
    list_filter = ["strategy"]
    search_fields = ["item__sku"]
    list_select_related = ["item"]
    date_hierarchy = "started_at"
    strategy_name = strategy_column("strategy")


@admin.register(Order)
class OrderAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "pk",
        "item",
        "buyer",
        "qty",
        "status",
        "served_by_name",
        "fallback",
        "created_at",
        "updated_at",
    ]
    list_filter = ["status", "served_by", "fallback"]
    search_fields = ["buyer", "idempotency_key", "item__sku"]
    list_select_related = ["item"]
    date_hierarchy = "created_at"
    show_full_result_count = False  # a flood leaves many rows; skip the extra COUNT(*)
    served_by_name = strategy_column("served_by", "served by")
