from django.contrib import admin

from .models import Item, Order, Sale, StockShard


class StockShardInline(admin.TabularInline):
    model = StockShard
    extra = 0
    readonly_fields = ["index", "stock", "version"]
    can_delete = False


@admin.register(Item)
class ItemAdmin(admin.ModelAdmin):
    list_display = ["sku", "name", "price", "stock", "strategy", "per_buyer_limit"]
    list_filter = ["strategy"]
    search_fields = ["sku", "name"]
    readonly_fields = ["version", "shard_count", "current_sale"]
    inlines = [StockShardInline]


@admin.register(Sale)
class SaleAdmin(admin.ModelAdmin):
    list_display = ["item", "initial_stock", "strategy", "per_buyer_limit", "started_at"]
    list_filter = ["strategy"]


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["pk", "item", "buyer", "qty", "status", "served_by", "fallback", "created_at"]
    list_filter = ["status", "served_by", "fallback"]
    search_fields = ["buyer", "idempotency_key", "item__sku"]
    list_select_related = ["item"]
