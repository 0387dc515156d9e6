"""Helpers shared by the test suite (no fixtures here: import what you need)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    """URL of the shared test Redis: $REDIS_URL, else the local default."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def unique_prefix(label: str = "test") -> str:
    """A key prefix no other test run uses, e.g. ``test:lock:3f2a...:``."""
    return f"test:{label}:{uuid.uuid4().hex}:"


def delete_prefix(client: Any, prefix: str) -> int:
    """Delete every key starting with ``prefix``; returns how many were deleted."""
    deleted = 0
    batch = []
    for key in client.scan_iter(match=_glob_escape(prefix) + "*", count=500):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch.clear()
    if batch:
        deleted += client.delete(*batch)
    return deleted


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def gather_from_processes(processes: list[Any], results: Any, *, timeout: float = 60) -> list:
    """Start the processes, take one item each from ``results``, and leave none running."""
    for process in processes:
        process.start()
    try:
        return [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()


def run_in_thread(target) -> tuple[threading.Thread, dict]:
    """Start target() in a thread; the dict gets 'result' or 'error' and 'at' (monotonic)."""
    outcome: dict = {}

    def body() -> None:
        try:
            outcome["result"] = target()
        except BaseException as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def flood_sells_exactly_the_stock(url: str, sku: str, *, stock: int, attempts: int, buyers: int):
    """Flood a running `lua` sale of `stock` units (started by the caller) with more attempts
    than units, and assert exactly the stock was sold: each 201 a committed order, every other
    answer sold out, the database and Redis at 0. Returns the sale's orders."""
    from inventory.models import Order
    from inventory.selectors import audit_sale
    from loadtest.flood import flood

    result = flood(url, sku, attempts=attempts, concurrency=buyers)
    context = f"{sku}: {dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0 and result.server_errors == 0, context
    assert result.accepted == stock, context
    assert result.errors == {"sold_out": attempts - stock}, context
    stored = Order.objects.filter(item__sku=sku)
    placed = sorted(str(pid) for pid in stored.values_list("public_id", flat=True))
    assert sorted(result.order_ids) == placed, context
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["remaining"] == 0, audit
    assert audit["db_stock"] == audit["redis_stock"] == 0 and audit["consistent"], audit
    return stored
