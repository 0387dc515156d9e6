"""A flood of buyers hitting the HTTP API from separate processes, counting every answer.

Each buyer process sends its share of checkout attempts one after another on its own
connections; the parent gathers what came back. Nothing is inferred: every 201's order id and
every status code is returned for the caller to check against the database. A buyer may retry
a `503 busy` as a client told to retry does (`retry_busy`): the shop promises that such an
answer sold nothing, so the counts stay exact however often a loaded host answers it.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
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
    #: `503 busy` answers retried (with `retry_busy`); only each attempt's last answer is
    #: counted in `statuses`.
    busy_retried: int = 0

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
        self.busy_retried += other.busy_retried


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
    retry_busy: int = 0


def _checkout(
    share: _Share, fields: dict[str, object]
) -> tuple[int, dict[str, Any] | None, str | None] | None:
    """POST one checkout on a new connection: its status, its JSON body (None when not JSON)
    and its Retry-After; None when the connection failed."""
    parts = urlsplit(share.url)
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
        return None
    finally:
        connection.close()
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        payload = None
    return response.status, payload, response.getheader("Retry-After")


def _buy(share: _Share) -> FloodResult:
    result = FloodResult()
    for attempt in range(share.attempts):
        buyer = f"{share.buyer_prefix}-{share.worker}-{attempt}"
        fields: dict[str, object] = {"sku": share.sku, "qty": share.qty, "buyer": buyer}
        if share.keyed:
            fields["idempotency_key"] = f"key-{buyer}"
        for retry in range(share.retry_busy + 1):
            answer = _checkout(share, fields)
            if answer is None:
                break
            status, payload, retry_after = answer
            busy = status == 503 and payload is not None and payload.get("error") == "busy"
            if not (busy and retry_after and retry_after.isdigit()) or retry == share.retry_busy:
                break
            result.busy_retried += 1
            time.sleep(float(retry_after))
        if answer is None:
            result.transport_failures += 1
            result.failed_at.append(time.monotonic())
            result.answers[buyer] = 0
            continue
        result.statuses[status] += 1
        result.answers[buyer] = status
        if payload is None:
            result.not_json += 1
            payload = {}
        if status == 201:
            result.order_ids.append(payload["order"])
        else:
            result.errors[payload.get("error", "?")] += 1
        if status == 503 and not retry_after:
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
    retry_busy: int = 0,
) -> FloodResult:
    """Send `attempts` checkouts of qty units of sku from `concurrency` processes at once
    (`keyed`: each with an idempotency key of its own). `retry_busy`: how many times a buyer
    answered `503 busy` with a Retry-After sends the same checkout again, after waiting what
    the header says; the last answer is the attempt's."""
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
            retry_busy=retry_busy,
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
