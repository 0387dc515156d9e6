"""How the lab page shows the scenarios' words and figures: `code` in their sentences as code,
the figures of a run under names a reader reads (`most holders at once`, not `most_holders`)."""

from __future__ import annotations

import re
from typing import Any

from django import template
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

register = template.Library()

CODE_SPAN = re.compile(r"`([^`]+)`")

#: The scenarios' figures (`Outcome.details`) by their key; a key missing here reads as its
#: words, with A and B, the clients, in capitals.
FIGURE_LABELS = {
    "a_answer": "A's answer",
    "accepted": "units accepted",
    "acquire_with_the_replica_up": "acquired with the replica's link up",
    "acquisitions": "acquisitions",
    "b_got_the_lock": "B got the lock",
    "b_granted_once_a_released": "B granted the lock once A released it",
    "b_waited_seconds": "B waited (s)",
    "busy": "checkouts answered busy",
    "checkouts": "checkouts",
    "item_row_fence": "the item row's fence",
    "left": "units left",
    "lock_left": "locks left",
    "lock_left_for_seconds": "lock left for (s)",
    "lock_ttl_ms": "lock TTL (ms)",
    "masters_holding_a_after_the_failover": "masters holding A's lock after the failover",
    "most_at_once": "most sales at once",
    "most_holders": "most holders at once",
    "most_holders_on_the_quorum": "most holders at once, on the quorum",
    "most_holders_waiting_for_the_replica": "most holders at once, waiting for the replica",
    "quorum_fences": "fences handed to A and B",
    "replies_lost": "replies lost",
    "round_trips": "round trips to Redis",
    "served_by_the_fallback": "served by the fallback",
    "shards": "shards",
    "sku": "item (SKU)",
    "sold": "units sold",
    "stock": "stock",
    "stock_went_down_by": "stock went down by",
    "strategy": "strategy",
    "ttl": "lock TTL (s)",
    "units_sold": "units sold",
    "wait_p50_ms": "wait p50 (ms)",
    "wait_p99_ms": "wait p99 (ms)",
}


@register.filter
def code_spans(text: str) -> SafeString:
    """The text, escaped, with each `span` between backticks set as code."""
    return mark_safe(CODE_SPAN.sub(r"<code>\1</code>", escape(text)))  # escaped first


@register.filter
def figure_label(key: str) -> str:
    if key in FIGURE_LABELS:
        return FIGURE_LABELS[key]
    words = [word.upper() if word in ("a", "b") else word for word in key.split("_")]
    return " ".join(words)


@register.filter
def figure_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(figure_value(item) for item in value)
    return str(value)
