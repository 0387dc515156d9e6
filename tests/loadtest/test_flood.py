"""The flood's client rules, against a stand-in shop that answers as told: a `503 busy` with a
Retry-After is sent again when the caller allows it, and only each attempt's last answer is
counted. (The shop's own answers are held to these rules by the flood tests that use it.)"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.flood import flood


class _StandIn(ThreadingHTTPServer):
    """Answers each buyer `busy` its first `busy_first` checkouts, then `201`."""

    daemon_threads = True

    def __init__(self, busy_first: int, retry_after: str | None) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.busy_first = busy_first
        self.retry_after = retry_after
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()


class _Answer(BaseHTTPRequestHandler):
    server: _StandIn

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        fields = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.seen[fields["buyer"]] += 1
            busy = self.server.seen[fields["buyer"]] <= self.server.busy_first
        body = json.dumps({"error": "busy"} if busy else {"order": f"order-{fields['buyer']}"})
        self.send_response(503 if busy else 201)
        if busy and self.server.retry_after is not None:
            self.send_header("Retry-After", self.server.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def stand_in(request) -> Iterator[_StandIn]:
    busy_first, retry_after = request.param
    server = _StandIn(busy_first, retry_after)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: _StandIn) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("stand_in", [(2, "0")], indirect=True)
def test_a_busy_answer_is_sent_again_and_only_the_last_answer_counts(stand_in):
    # Given a shop that answers each buyer busy twice (Retry-After: 0), then sells
    # When 12 buyers flood it, each allowed 3 retries of a busy answer
    result = flood(_url(stand_in), "sku", attempts=12, concurrency=3, retry_busy=3)

    # Then each checkout was sent three times, and each is counted once, sold
    assert set(stand_in.seen.values()) == {3} and len(stand_in.seen) == 12
    assert result.statuses == {201: 12} and result.accepted == 12
    assert result.busy_retried == 24
    assert sorted(result.order_ids) == sorted(f"order-{buyer}" for buyer in stand_in.seen)
    assert result.answers == dict.fromkeys(stand_in.seen, 201)


@pytest.mark.parametrize("stand_in", [(5, "0")], indirect=True)
def test_a_buyer_out_of_retries_keeps_its_busy_answer(stand_in):
    # Given a shop that answers busy five times; when a buyer may retry twice
    result = flood(_url(stand_in), "sku", attempts=4, concurrency=2, retry_busy=2)

    # Then its third busy answer is the one counted
    assert set(stand_in.seen.values()) == {3}
    assert result.statuses == {503: 4} and result.errors == {"busy": 4}
    assert result.busy_retried == 8 and result.server_errors == 4


@pytest.mark.parametrize("stand_in", [(1, "0"), (1, None)], indirect=True)
def test_without_retries_or_without_retry_after_a_busy_answer_is_not_sent_again(stand_in):
    # Given a shop that answers each buyer busy once
    retry = 3 if stand_in.retry_after is None else 0

    # When buyers flood it without leave to retry, or it sends no Retry-After
    result = flood(_url(stand_in), "sku", attempts=4, concurrency=2, retry_busy=retry)

    # Then every checkout is sent once and answered busy
    assert set(stand_in.seen.values()) == {1}
    assert result.statuses == {503: 4} and result.busy_retried == 0
    assert result.busy_without_retry_after == (4 if stand_in.retry_after is None else 0)
