"""A flood of buyers hitting the HTTP API from separate processes, counting every answer.

Each buyer process sends its share of checkout attempts one after another on its own
connections; the parent gathers what came back. Nothing is inferred: every 201's order id and
every status code is returned for the caller to check against the database.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class FloodResult:
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    #: The public ids of the orders the 201s named.
    order_ids: list[str] = field(default_factory=list)
    transport_failures: int = 0
    #: When each transport failure was seen (`time.monotonic()`, one clock for every process
    #: of the host).
    failed_at: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    #: Each attempt's buyer (unique per attempt) and the status it was answered (0: none, the
    #: connection failed), to hold each order in the database to the answer its buyer got.
    answers: dict[str, int] = field(default_factory=dict)
    #: Answers whose body was not JSON, and `503`s without a Retry-After.
    not_json: int = 0
    busy_without_retry_after: int = 0

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + self.transport_failures

    @property
    def accepted(self) -> int:
        return self.statuses[201]

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.elapsed if self.elapsed else 0.0

    def merge(self, other: FloodResult) -> None:
        self.statuses.update(other.statuses)
        self.errors.update(other.errors)
        self.order_ids.extend(other.order_ids)
        self.transport_failures += other.transport_failures
        self.failed_at.extend(other.failed_at)
        self.answers.update(other.answers)
        self.not_json += other.not_json
        self.busy_without_retry_after += other.busy_without_retry_after


@dataclass(frozen=True)
class _Share:
    url: str
    sku: str
    qty: int
    attempts: int
    buyer_prefix: str
    worker: int
    pause: float
    timeout: float
    keyed: bool = False


def _buy(share: _Share) -> FloodResult:
    parts = urlsplit(share.url)
    result = FloodResult()
    for attempt in range(share.attempts):
        buyer = f"{share.buyer_prefix}-{share.worker}-{attempt}"
        fields: dict[str, object] = {"sku": share.sku, "qty": share.qty, "buyer": buyer}
        if share.keyed:
            fields["idempotency_key"] = f"key-{buyer}"
        connection = http.client.HTTPConnection(
            parts.hostname or "127.0.0.1", parts.port, timeout=share.timeout
        )
        try:
            connection.request(
                "POST", "/api/checkout", json.dumps(fields), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException):
            result.transport_failures += 1
            result.failed_at.append(time.monotonic())
            result.answers[buyer] = 0
            continue
        finally:
            connection.close()
        result.statuses[response.status] += 1
        result.answers[buyer] = response.status
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            result.not_json += 1
            payload = {}
        if response.status == 201:
            result.order_ids.append(payload["order"])
        else:
            result.errors[payload.get("error", "?")] += 1
        if response.status == 503 and not response.getheader("Retry-After"):
            result.busy_without_retry_after += 1
        if share.pause:
            time.sleep(share.pause)
    return result


def flood(
    url: str,
    sku: str,
    *,
    attempts: int,
    concurrency: int,
    qty: int = 1,
    buyer_prefix: str = "buyer",
    pause: float = 0.0,
    timeout: float = 30.0,
    keyed: bool = False,
) -> FloodResult:
    """Send `attempts` checkouts of qty units of sku from `concurrency` processes at once
    (`keyed`: each with an idempotency key of its own)."""
    shares = [
        _Share(
            url=url,
            sku=sku,
            qty=qty,
            attempts=attempts // concurrency + (1 if worker < attempts % concurrency else 0),
            buyer_prefix=buyer_prefix,
            worker=worker,
            pause=pause,
            timeout=timeout,
            keyed=keyed,
        )
        for worker in range(concurrency)
    ]
    total = FloodResult()
    with multiprocessing.get_context("fork").Pool(concurrency) as pool:
        started = time.perf_counter()
        for part in pool.imap_unordered(_buy, shares):
            total.merge(part)
        total.elapsed = time.perf_counter() - started
    return total
