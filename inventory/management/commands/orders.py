"""`manage.py orders sweep`: expire overdue orders and enqueue again the ones left open."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandParser
from django.template.defaultfilters import pluralize

from inventory import orders


class Command(BaseCommand):
    help = (
        "Order maintenance: `sweep` expires orders past the hold time and re-enqueues stale ones."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="{sweep}")
        actions.add_parser("sweep", help="expire overdue orders; enqueue again stale open ones")

    def handle(self, *args: object, **options: object) -> None:
        report = orders.sweep_orders()
        expired = len(report.expired)
        self.stdout.write(
            f"expired {expired} order{pluralize(expired)}, enqueued {len(report.requeued)} again"
        )
        if report.not_requeued:
            self.stderr.write(
                f"{report.not_requeued} open order{pluralize(report.not_requeued)} not enqueued: "
                "the broker is unreachable"
            )
