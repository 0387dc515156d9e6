"""`manage.py sale start|restock|audit|reconcile`: run a sale and check its invariants."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from inventory import orders, selectors, services
from inventory.exceptions import CheckoutError
from inventory.strategies import strategy_names


def _decimal(value: str) -> Decimal:
    try:
        return Decimal(value)
    except InvalidOperation:
        raise ValueError(value) from None


class Command(BaseCommand):
    help = "Start a sale of an item, or audit the current one."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(
            dest="action", required=True, metavar="{start,restock,audit,reconcile}"
        )
        start = actions.add_parser(
            "start",
            help="(Re)start the sale of SKU: create it if new, open a new sale with this stock "
            "and strategy (earlier sales and their orders stay as history), warm Redis.",
        )
        start.add_argument("sku")
        start.add_argument("--stock", type=int, required=True, help="units for sale")
        start.add_argument(
            "--strategy",
            default=None,
            choices=strategy_names(),
            help="how its stock is decremented (default: FLASHSALE_DEFAULT_STRATEGY)",
        )
        start.add_argument("--limit", type=int, default=None, help="most units per buyer")
        start.add_argument("--name", default=None, help="display name (default: from the sku)")
        start.add_argument("--price", type=_decimal, default=None)
        start.add_argument(
            "--opens-in",
            type=float,
            default=0,
            metavar="SECONDS",
            help="open checkout this many seconds from now (default: at once)",
        )
        restock = actions.add_parser(
            "restock",
            help="Add units to SKU's running sale, safely while it sells (Redis hears of them "
            "once the database has them).",
        )
        restock.add_argument("sku")
        restock.add_argument("--add", type=int, required=True, metavar="N", help="units to add")
        audit = actions.add_parser("audit", help="Check SKU's invariants after a sale.")
        audit.add_argument("sku")
        audit.add_argument("--json", action="store_true", help="print one JSON object")
        reconcile = actions.add_parser(
            "reconcile",
            help="Recompute SKU's stock from its orders; repair its item or stock rows, and Redis.",
        )
        reconcile.add_argument("sku")

    def handle(self, *args: object, **options: object) -> None:
        try:
            if options["action"] == "start":
                self._start(options)
            elif options["action"] == "restock":
                self._restock(options)
            elif options["action"] == "audit":
                self._audit(options)
            else:
                self._reconcile(options)
        except CheckoutError as error:
            raise CommandError(error.detail) from None

    def _start(self, options: dict) -> None:
        sale = services.start_sale(
            sku=options["sku"],
            stock=options["stock"],
            strategy=options["strategy"],
            limit=options["limit"],
            name=options["name"],
            price=options["price"],
            opens_in=options["opens_in"],
        )
        limit = f", at most {sale.per_buyer_limit} per buyer" if sale.per_buyer_limit else ""
        self.stdout.write(
            f"sale {sale.pk} of {sale.item.sku} started: {sale.initial_stock} "
            f"unit{pluralize(sale.initial_stock)} through "
            f"{sale.strategy}{limit}"
        )

    def _restock(self, options: dict) -> None:
        added = options["add"]
        sale = services.restock(sku=options["sku"], units=added)
        self.stdout.write(
            f"sale {sale.pk} of {sale.item.sku}: {added} unit{pluralize(added)} added "
            f"({sale.initial_stock} at the start, {sale.supply} in all)"
        )

    def _reconcile(self, options: dict) -> None:
        selectors.get_item(options["sku"])  # unknown sku: a clear error, not a traceback
        try:
            changes = orders.reconcile_sale(options["sku"])
        except orders.RepairInProgress as exc:
            raise CommandError(f"{exc}: run it again in a moment") from exc
        for change in changes:
            self.stdout.write(change)
        if not changes:
            self.stdout.write(f"{options['sku']}: database, stock rows and Redis already agree")

    def _audit(self, options: dict) -> None:
        report = selectors.audit_sale(options["sku"])
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        width = max(map(len, report))
        for key, value in report.items():
            self.stdout.write(f"{key:<{width}}  {_plain(value)}")


def _plain(value: object) -> str:
    """A figure of the audit as a reader reads it: `pending: 2, paid: 0`, not a Python dict."""
    if isinstance(value, list):
        return (
            "; ".join(
                f"{item['at']} ({item['cause']}): {', '.join(item['changes'])}"
                if isinstance(item, dict) and "changes" in item
                else _plain(item)
                for item in value
            )
            or "-"
        )
    if isinstance(value, dict):
        return ", ".join(f"{key}: {_plain(figure)}" for key, figure in value.items()) or "-"
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
