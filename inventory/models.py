"""Items, their stock shards, sales and orders.

The database is the system of record: every stock change is a guarded UPDATE on these rows, and
the constraints below are the last line of defence (stock never negative, one order per
idempotency key, a buyer never past the item's limit).
"""

from __future__ import annotations

import os
import re
import time
import uuid

from django.conf import settings
from django.contrib.postgres.functions import RandomUUID
from django.db import models
from django.db.models import Q
from django.db.models.functions import Coalesce
from django.utils import timezone

#: What a sku may be: the slug the `sku` field stores (also what URLs and Redis keys carry).
SKU_PATTERN = re.compile(r"[-a-zA-Z0-9_]{1,64}")


def default_strategy() -> str:
    """What an item sells by until a sale names one (FLASHSALE_DEFAULT_STRATEGY)."""
    return settings.FLASHSALE_DEFAULT_STRATEGY


# Strategy names are validated where they come in (`inventory.strategies.strategy_names`, the
# one list); the fields hold the name and carry no choices of their own to keep in step.


class ItemQuerySet(models.QuerySet):
    def with_units_left(self) -> ItemQuerySet:
        """Annotate each item with the units its current sale has left (`Item.units_left`)."""
        rows = (
            StockShard.objects.filter(sale_id=models.OuterRef("current_sale_id"))
            .order_by()
            .values("sale_id")
            .annotate(total=models.Sum("stock"))
            .values("total")
        )
        return self.annotate(
            derived_units_left=models.Case(
                models.When(shard_count=0, then=models.F("stock")),
                default=Coalesce(models.Subquery(rows), 0),
            )
        )


class Item(models.Model):
    sku = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    price = models.DecimalField(max_digits=10, decimal_places=2, default=0)
    stock = models.IntegerField(
        default=0,
        help_text="Units left, per the database, for an item sold from this row alone; for one "
        "sold from stock rows (shard_count > 0) the sale's starting stock, folded in again by "
        "`sale reconcile`: its units left are the sum of its rows (units_left).",
    )
    version = models.BigIntegerField(default=0, help_text="Bumped by every stock write.")
    fence = models.BigIntegerField(
        default=0,
        db_default=0,
        help_text="The fencing token of the latest lock holder whose sale this row accepted: "
        "the sale statement refuses a holder with an older one (its lock expired under it).",
    )
    strategy = models.CharField(max_length=16, default=default_strategy)
    per_buyer_limit = models.PositiveIntegerField(
        null=True, blank=True, help_text="Most units one buyer may hold; empty for no limit."
    )
    shard_count = models.PositiveSmallIntegerField(
        default=0, help_text="How many stock shards hold this item's units (0: none)."
    )
    current_sale = models.ForeignKey(
        "Sale", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ItemQuerySet.as_manager()

    class Meta:
        ordering = ["sku"]
        constraints = [
            models.CheckConstraint(condition=Q(stock__gte=0), name="item_stock_not_negative"),
            models.CheckConstraint(condition=Q(price__gte=0), name="item_price_not_negative"),
            models.CheckConstraint(
                condition=Q(per_buyer_limit__isnull=True) | Q(per_buyer_limit__gte=1),
                name="item_per_buyer_limit_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.sku

    @property
    def units_left(self) -> int:
        """Units the current sale has left in the database (the system of record).

        The item row's stock, or for an item sold from stock rows the sum of its current sale's
        rows. Read from the `with_units_left()` annotation when the item was loaded with it.
        """
        annotated = self.__dict__.get("derived_units_left")
        if annotated is not None:
            return annotated
        if not self.shard_count or self.current_sale_id is None:
            return self.stock
        total = StockShard.objects.filter(sale_id=self.current_sale_id).aggregate(
            total=models.Sum("stock")
        )["total"]
        return total or 0


class StockShard(models.Model):
    """One stock row of a sale: a `segmented` shard or a `lua` stripe.

    For an item sold from stock rows these rows are the system of record for its units: a sale
    decrements its row(s) and never the item row, so buyers contend on one row in
    `shard_count`, not all on one. The item's stock is derived: the sum of its current sale's
    rows (`Item.units_left`). Rows belong to one sale: a restarted sale gets new rows, and a
    checkout still in flight for the old sale can only take the old sale's units.
    """

    item = models.ForeignKey(Item, on_delete=models.CASCADE, related_name="shards")
    sale = models.ForeignKey("Sale", on_delete=models.CASCADE, related_name="shards")
    index = models.PositiveSmallIntegerField()
    stock = models.IntegerField(default=0)
    version = models.BigIntegerField(default=0)
    #: The fencing token of the latest shard-lock holder whose sale this row accepted.
    fence = models.BigIntegerField(default=0, db_default=0)
    #: Units ever put in this row: its share of the sale's initial stock, plus restocks.
    supplied = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["sale", "index"]
        constraints = [
            models.UniqueConstraint(fields=["sale", "index"], name="shard_unique_sale_index"),
            models.CheckConstraint(condition=Q(stock__gte=0), name="shard_stock_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.item_id}#{self.index}"


class Sale(models.Model):
    """One (re)start of an item's sale: what it started with and how it sells."""

    item = models.ForeignKey(Item, on_delete=models.CASCADE, related_name="sales")
    initial_stock = models.PositiveIntegerField()
    added_stock = models.PositiveIntegerField(
        default=0, help_text="Units added to the running sale by `sale restock`."
    )
    strategy = models.CharField(max_length=16)
    per_buyer_limit = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    opens_at = models.DateTimeField(
        default=timezone.now, help_text="Checkouts before this are refused (not_started)."
    )

    class Meta:
        ordering = ["-started_at", "-pk"]
        get_latest_by = ["started_at", "pk"]

    def __str__(self) -> str:
        return f"{self.item.sku} x{self.supply} ({self.strategy})"

    @property
    def supply(self) -> int:
        """Every unit the sale has had to sell: its initial stock and its restocks."""
        return self.initial_stock + self.added_stock


class SaleRepair(models.Model):
    """Drift found between a sale's orders, its stock rows or item row and Redis, and put right:
    by whom (`cause`) and what changed, a line each (`inventory.orders.reconcile_sale`)."""

    class Cause(models.TextChoices):
        RECONCILER = "reconciler", "the periodic reconciler"
        COMMAND = "command", "sale reconcile"
        REDIS_BACK = "redis_back", "Redis back after an outage"
        PROCESS_START = "process_start", "a web process starting"

    sale = models.ForeignKey(Sale, on_delete=models.CASCADE, related_name="repairs")
    made_at = models.DateTimeField(auto_now_add=True)
    cause = models.CharField(max_length=16, choices=Cause.choices)
    changes = models.JSONField(default=list)

    class Meta:
        ordering = ["-made_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.sale}: {self.get_cause_display()}, {len(self.changes)} change(s)"


class OrderStatus(models.TextChoices):
    PENDING = "pending"
    PAID = "paid"
    CONFIRMED = "confirmed"
    FAILED = "failed"
    EXPIRED = "expired"


#: Orders in these states hold their units; failed and expired ones have given them back.
LIVE_STATUSES = (OrderStatus.PENDING, OrderStatus.PAID, OrderStatus.CONFIRMED)


def new_public_id() -> uuid.UUID:
    """A new order's public id: a UUID of version 7 (RFC 9562), the millisecond it was made
    followed by 74 random bits.

    Unguessable by its random bits, as a random (version 4) UUID is; its time is the order's
    `created_at`, which the order shows anyway. Ids made one after another sort one after
    another, so each order's entry lands on the last pages of the public id's unique index
    instead of a random page of it, which PostgreSQL would write whole to its log the first time
    it changes after a checkpoint (docs/design.md, "The order's public id")."""
    milliseconds = time.time_ns() // 1_000_000
    random_bits = int.from_bytes(os.urandom(10), "big")
    value = (
        (milliseconds & 0xFFFF_FFFF_FFFF) << 80
        | 0x7 << 76  # version 7
        | (random_bits >> 68) << 64  # rand_a: 12 bits
        | 0b10 << 62  # the RFC's variant
        | random_bits & 0x3FFF_FFFF_FFFF_FFFF  # rand_b: 62 bits
    )
    return uuid.UUID(int=value)


class Order(models.Model):
    #: The order's id outside the shop (API, pages, links): unguessable, so an order is seen
    #: only by whoever was given its id (the buyer), never by counting up from one's own; made
    #: by `new_public_id` (the database's own default, a random UUID, only for rows written
    #: without one).
    public_id = models.UUIDField(
        unique=True, editable=False, default=new_public_id, db_default=RandomUUID()
    )
    # No index of its own: order_item_status leads with it (every index is written by every
    # sale, so the orders carry only those a query reads).
    item = models.ForeignKey(Item, on_delete=models.PROTECT, related_name="orders", db_index=False)
    sale = models.ForeignKey(Sale, on_delete=models.PROTECT, related_name="orders")
    buyer = models.CharField(max_length=64)
    qty = models.PositiveIntegerField()
    status = models.CharField(
        max_length=16, choices=OrderStatus.choices, default=OrderStatus.PENDING
    )
    # Unique through a constraint (Meta), which, unlike unique=True, does not also get a
    # `varchar_pattern_ops` index for LIKE queries that nothing runs. NULL, not "", for no key:
    # the constraint admits any number of NULLs.
    idempotency_key = models.CharField(max_length=128, null=True, blank=True)  # noqa: DJ001
    served_by = models.CharField(
        max_length=16,
        help_text="The strategy that took the units (optimistic when the fallback served).",
    )
    fallback = models.BooleanField(default=False, help_text="Served while Redis was down.")
    requeued_at = models.DateTimeField(
        null=True, blank=True, help_text="When the sweeper last enqueued it again."
    )
    shard_units = models.JSONField(
        null=True, blank=True, help_text="Units taken per shard index, for sharded items."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [
            models.Index(fields=["item", "status"], name="order_item_status"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(qty__gte=1), name="order_qty_positive"),
            models.UniqueConstraint(
                fields=["idempotency_key"], name="order_unique_idempotency_key"
            ),
        ]

    def __str__(self) -> str:
        return f"order {self.pk} {self.item_id} x{self.qty} ({self.status})"

    @property
    def reference(self) -> str:
        """A short name for the order on its page: its public id's last 12 hex digits, 48 of its
        random bits (its first ones are the millisecond it was placed, which orders share)."""
        return str(self.public_id)[-12:]


class PaymentAttempt(models.Model):
    """One run of the (simulated) payment for an order; written in the transaction that moves
    the order out of `pending`, so a worker killed mid-payment leaves no attempt behind."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payment_attempts")
    approved = models.BooleanField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"payment of order {self.order_id}: {'approved' if self.approved else 'declined'}"


class BuyerAllowance(models.Model):
    """Units a buyer holds in one sale of an item, capped by the database at the sale's limit."""

    item = models.ForeignKey(Item, on_delete=models.CASCADE, related_name="allowances")
    sale = models.ForeignKey("Sale", on_delete=models.CASCADE, related_name="allowances")
    buyer = models.CharField(max_length=64)
    units = models.PositiveIntegerField(default=0)
    unit_limit = models.PositiveIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["sale", "buyer"], name="allowance_unique_sale_buyer"),
            models.CheckConstraint(
                condition=Q(units__lte=models.F("unit_limit")), name="allowance_within_limit"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.buyer}: {self.units}/{self.unit_limit} of item {self.item_id}"


class LockFence(models.Model):
    """The latest fencing token handed out for a lock name by the database (`inventory.fences`):
    the one source a quorum lock's fences come from, since no single master's may."""

    name = models.CharField(max_length=200, primary_key=True)
    fence = models.BigIntegerField()

    def __str__(self) -> str:
        return f"{self.name}: {self.fence}"
