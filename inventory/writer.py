"""The sale writer: one process that writes the sales of `lua` and `segmented` for every web
process, several to a commit.

With FLASHSALE_SALE_WRITER naming a unix socket, a `lua` checkout sends its sale to the writer
(`python manage.py sale writer`) and waits for one answer, instead of calling Redis and then the
database itself. The writer's one thread takes the units of the requests that have arrived in
one script (the same check-and-DECRBY a direct checkout runs, per request), writes the sales
that got units in one statement and one commit (`inventory.stock.sell_batch`'s: each sale keeps
its own guards), answers each buyer once its order row is committed, and hands the batch's
orders to the order workers (`publishing.hand_over`: the buyers' processes publish none). The
web processes relay the orders of the sales they write themselves to it as well
(`OrderRelay`), which it publishes with these.

A `segmented` checkout holding a shard's lock sends its sale the same way (`write_request`):
the rows it holds and their fencing tokens, no take. It joins the batch as it is, its rows
fenced in the statement as in its own, and is answered with their levels after the commit (its
hints). The locks it names (`write_request`'s `releases`) the writer releases right after that
commit, the hints copied with them (`_release`). Ten shards let ten holders wait on the writer
at once, and their sales share commits: a single lock (`lock`) has one holder at a time and
nothing to share, so it writes its own. A holder whose batch was refused (a row short, a token
refused) is answered `again` and writes its sale itself, still under its locks: that write
tells it which.

The statement is sent without waiting for it (`stock.BatchInFlight`): while PostgreSQL writes
and commits one batch, the writer reads and takes the next, and sends it as soon as the first
is answered, so that the take is off the path a sale waits on; with
FLASHSALE_SALE_WRITER_CONNECTIONS above 1, at once on a connection with no statement in flight
(where each statement's round trip is long: a database across a network). With no statement in
flight it takes what has arrived at once; with one in flight, once every buyer its last answer
reached has sent again (they come back a few hundred microseconds apart, each with its own work
to do first), or FLASHSALE_SALE_WRITER_LINGER_US after the first of them did: buyers answered
together stay together, in batches as large as they allow. Once a statement is over, the next
batch waits for the buyers it answered on their connections too, as long as that statement took
at most: back by then (a buyer process is, in a fraction of a millisecond), they go in it, so
that such buyers make one group, written by one statement, rather than two groups taking turns
at the connection, each paying a statement for half of them. A lone request waits for company:
for the statement in flight, or for the linger when there is none (a web process serving a
crowd rarely comes back with its group: taken alone, each request would cost a script and a
statement); checkouts handed off with their clients' connections (`lua`'s, and `segmented`'s,
whose shards the writer locks only when it takes them), which never come back as a group, wait
for FLASHSALE_SALE_WRITER_COMPANY of them (or the linger) before they go with
nothing in flight. When a lock holder's sale is among the requests, the linger is
FLASHSALE_SALE_WRITER_HOLDER_LINGER_US: its shard stays locked while it waits.
Right after sending a batch's statement, the writer takes ahead, in one script, as many units
of each sale as the batch sells (FLASHSALE_SALE_WRITER_AHEAD_MS: how long they wait; 0: never):
the buyers' next requests are served from them with no script on the path they wait on, the
script having run while PostgreSQL wrote. Held units go back when unused, when the writer
stops, and before any buyer is told sold out; when Redis fails they are dropped, and the
counters' rebuild from the database puts them back.
One thread, because a second one only moved the batch between threads: with a taker and a
committer the writer spent half as much CPU again per sale, in their hand-over and their turns
at the interpreter lock, and sold no faster (docs/design.md).

A buyer that cannot reach the writer sells the direct way. A buyer whose writer fails after the
request was sent answers `503 busy`: the sale may have been committed (a retry with the
idempotency key finds it), so no fallback may sell it again. When Redis fails in the take,
nothing was written and nothing will be: the buyer gets Redis's error, and the fallback serves
it, as for a direct checkout. The failure opens the writer's breaker in front of Redis (the
process's, `inventory.breaker`): until its probe, run in a thread of its own, finds Redis back
and rebuilt, the writer calls no script and answers every take and lock at once as Redis's
error, so that a Redis that hangs stalls the one thread for one timeout, not one per batch.

The protocol is one JSON object per line each way; one request at a time per connection.
A request to take is `sale_request`'s, one to write as it is `write_request`'s.

A `lua` or `segmented` checkout served by `shop.handoff.HandOffWorker` (the shop's gunicorn
worker) need not wait at all: its request goes with the client's connection (`HandOff`: a
`reply` field, and the connection's descriptor passed with the line, SCM_RIGHTS) before it has
taken anything, and is answered nothing on this socket. For a `lua` checkout the writer takes
the units as for any other; for a `segmented` one (`lock_request`) it locks a shard whose hint
holds them, all of a batch's in one round trip (`_lock_shards`), and writes the sale as that
shard's holder would, its lock released with the commit; while every shard holding them is
locked, the checkout waits in the writer for the next release (FLASHSALE_LOCK_WAIT_MS at most).
The writer answers the client itself (`_Buyer`): 201 once the order row is committed, 409 when
sold out, and for every rarer outcome what a checkout sold the direct way answers, run in one
of its threads (`_answer_directly`). Checkouts with an idempotency key still wait: a retry of
theirs must find the order or a `503 busy`, never a dropped connection.
"""

from __future__ import annotations

import array
import bisect
import json
import logging
import math
import os
import resource
import select
import selectors
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import orjson
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connection, connections
from redis.exceptions import ResponseError

from locking import Lock, LockError, release_each_call, scripts
from locking.counter import Claim, LockFirst, StockCounter, Take

from . import keys, publishing, stock
from .breaker import breaker as redis_breaker
from .breaker import remember_unsettled
from .exceptions import Busy, SoldOut
from .metrics import NO_STRATEGY, OUTCOMES, SECONDS
from .redis_client import REDIS_DOWN_ERRORS, get_redis_client

logger = logging.getLogger(__name__)

#: Longest line either side sends; a longer one is a protocol error.
MAX_LINE = 64 * 1024
#: Most connections one read of a buyer's socket takes with its lines (`SCM_RIGHTS`).
MAX_FDS = 64
#: Threads that answer handed-off checkouts the writer's own thread does not (`_answer_directly`).
DIRECT_THREADS = 8
#: How often checkouts waiting for a shard's lock (`lock_request`) try again while no batch of
#: the writer's releases any (the locks are held by holders outside it), in seconds.
LOCK_RETRY = 0.002
#: The most shards a sale a `lock_request` names may have.
MAX_SHARDS = 1024

#: What a release of holders' locks may fail with: then their holders release them.
_RELEASE_ERRORS: tuple[type[Exception], ...] = (*REDIS_DOWN_ERRORS, ResponseError)
#: What a take or a lock is answered (`"e"`) while the writer's breaker in front of Redis is open.
BREAKER_OPEN = "the Redis breaker is open"


class WriterUnavailable(Exception):
    """The writer could not be reached: nothing was sent, the checkout may go the direct way."""


class WriterLost(Exception):
    """The request was sent but no answer came: it may have been written or not."""


def _line(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message, option=stock.JSON_OPTIONS | orjson.OPT_APPEND_NEWLINE)


#: The environ keys of a hand-off (`shop.handoff.HandOffWorker`): the client's connection the
#: worker offers, what the view leaves it to send, and the mark of a request served again
#: the direct way because nothing could be sent.
CLIENT = "flashsale.client"
HAND_OFF = "flashsale.hand_off"
DIRECT = "flashsale.direct"

_local = threading.local()


#: After a hand-off found no writer, how long this process's checkouts wait for theirs instead
#: of trying again (each try that fails serves its request twice).
UNREACHABLE_FOR = 1.0
_unreachable_until = 0.0


def may_hand_off() -> bool:
    """Whether the checkout running in this thread may give its connection to the writer (its
    view allowed it: `handing_off`), the writer not found missing in the last UNREACHABLE_FOR
    seconds."""
    return getattr(_local, "hand_off", False) and time.monotonic() >= _unreachable_until


@contextmanager
def handing_off(allowed: bool) -> Iterator[None]:
    """Within: `may_hand_off()` is `allowed` (unless the writer was just found missing)."""
    before = getattr(_local, "hand_off", False)
    _local.hand_off = allowed
    try:
        yield
    finally:
        _local.hand_off = before


@contextmanager
def direct_only() -> Iterator[None]:
    """Within: this thread's checkouts sell the direct way (`client()` is None): the writer's
    own threads answering a handed-off checkout (`_answer_directly`)."""
    _local.direct = True
    try:
        yield
    finally:
        _local.direct = False


class HandedOff(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a checkout that is to be answered by the writer, before it has taken anything:
    `request` is what to send it (with the sale's `sku` and `qty`). The view catches it and
    leaves a `HandOff` for the worker."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__("handed to the sale writer")
        self.request = request


@dataclass
class HandOff:
    """A checkout the worker is to send the writer with the client's connection (`send`):
    what it raised, and the request's `body`, to serve it again the direct way when nothing
    could be sent; `began`: when the view began it (`time.monotonic()`, one clock for the
    host's processes), from which the writer times it."""

    handed: HandedOff
    body: bytes
    began: float | None = None

    def send(self, sock: socket.socket, response: Any) -> bool:
        """Send the sale, the answer's headers so far (`response`: gunicorn's, after the
        middleware added its own) and the connection. False when nothing was sent."""
        sale_writer = client()
        if sale_writer is None:
            return False
        version = "HTTP/{}.{}".format(*response.req.version)
        headers = [
            [name, value]
            for name, value in response.headers
            if name.lower() not in ("content-type", "content-length")
        ]
        reply = {"version": version, "server": response.version, "headers": headers}
        try:
            request = {**self.handed.request, "reply": reply, "began": self.began}
            sale_writer.hand_off(request, sock.fileno())
        except WriterUnavailable as exc:
            global _unreachable_until
            _unreachable_until = time.monotonic() + UNREACHABLE_FOR
            _warn_once(f"{exc}; checkouts sell the direct way until it is back")
            return False
        return True


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


# -- the buyer's side --------------------------------------------------------------------------


class WriterClient:
    """One connection to the writer per process (and per thread), opened on first use."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._local = threading.local()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its answer. Raises WriterUnavailable when nothing was
        sent, WriterLost when the request went out and no answer came back."""
        sock, reader = self._connection()
        try:
            sock.sendall(_line(request))
        except OSError as exc:
            self._drop()
            raise WriterUnavailable(f"sale writer at {self.path}: {exc}") from None
        try:
            raw = reader.readline(MAX_LINE)
        except OSError as exc:
            self._drop()
            raise WriterLost(f"sale writer at {self.path}: {exc}") from None
        if not raw.endswith(b"\n"):
            self._drop()
            raise WriterLost(f"sale writer at {self.path} closed the connection")
        return orjson.loads(raw)

    def hand_off(self, request: dict[str, Any], fd: int) -> None:
        """Send a request with a connection for the writer to answer on (its descriptor); no
        answer comes on this socket. Raises WriterUnavailable when it was not sent whole (a
        part sent is dropped with the connection: the writer acts on whole lines only)."""
        sock, _ = self._connection()
        data = _line(request)
        fds = array.array("i", [fd])
        try:
            sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            if sent < len(data):
                sock.sendall(data[sent:])
        except OSError as exc:
            self._drop()
            raise WriterUnavailable(f"sale writer at {self.path}: {exc}") from None

    def _connection(self) -> tuple[socket.socket, Any]:
        held = getattr(self._local, "held", None)
        if held is not None and held[0] == os.getpid():
            return held[1], held[2]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise WriterUnavailable(f"sale writer at {self.path}: {exc}") from None
        reader = sock.makefile("rb")
        self._local.held = (os.getpid(), sock, reader)
        return sock, reader

    def _drop(self) -> None:
        held = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None and held[0] == os.getpid():
            held[2].close()
            held[1].close()


def writer_stats(path: str, timeout: float = 5.0) -> dict[str, Any]:
    """What the writer on `path` has done (`SaleWriter.stats`), over a connection of its own.
    Raises OSError when nobody answers there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(_line({"op": "stats"}))
        with sock.makefile("rb") as reader:
            raw = reader.readline(MAX_LINE)
    if not raw.endswith(b"\n"):
        raise ConnectionError(f"sale writer at {path} closed the connection")
    return orjson.loads(raw)


_clients: dict[tuple[int, str], WriterClient] = {}


def client() -> WriterClient | None:
    """This process's client of the configured writer; None when none is configured."""
    path = settings.FLASHSALE_SALE_WRITER
    if not path or getattr(_local, "direct", False):
        return None
    key = (os.getpid(), path)
    found = _clients.get(key)
    if found is None:
        found = _clients[key] = WriterClient(path, settings.FLASHSALE_GROUP_COMMIT_WAIT_MS / 1000)
    return found


def write_request(
    sale: dict[str, Any],
    rows: dict[int, int],
    fences: dict[int, int] | None,
    releases: dict[int, list[str]] | None = None,
) -> dict[str, Any]:
    """What a lock holder sends (`segmented`): the sale to write from the rows it holds the
    locks of ({index: units}), fenced by their tokens; no take, its units are the rows'. It is
    answered once committed, with its rows' levels and versions after the batch.

    `releases` ({index: [lock name, owner token, hint key]}, `plumbing.writer_releases`): the
    locks the writer is to release once the sale is committed, each with its row's level copied
    to the hint in the same call; the answer's `released` names those it released, which the
    holder then forgets (`Lock.released_elsewhere`), and it releases the others itself."""
    request: dict[str, Any] = {
        "write": {
            **sale,
            "rows": {str(index): units for index, units in rows.items()},
            "fences": {str(index): fence for index, fence in (fences or {}).items()},
        }
    }
    if releases:
        request["release"] = {str(index): held for index, held in releases.items()}
    return request


def lock_request(
    *, sku: str, shards: int, start: int, qty: int, sale: dict[str, Any], name: str
) -> dict[str, Any]:
    """What a `segmented` checkout hands off with its client's connection (`HandOff`) before it
    holds any lock: the writer locks a shard whose hint holds `qty` for it (from shard `start`
    on, in turn: `StockCounter.lock_first_holding`, the script a holder runs), writes the sale
    under that lock, fenced by its token, in a batch with the others, and releases the lock
    with the commit, the row's level copied to its hint. `shards`: how many the sale has (the
    writer names their hints and locks itself, `keys.shard_keys`); `name`: shard `start`'s
    lock as the buyer's process names it, which the writer checks against its own (a writer
    with another FLASHSALE_REDIS_PREFIX would lock other keys than the buyers' holders do)."""
    lock = {"shards": shards, "start": start, "name": name}
    return {"sku": sku, "qty": qty, "lock": lock, "sale": sale}


#: The most order keys one relay (`orders_request`) may carry.
MAX_RELAYED = 1000


def orders_request(order_pks: list[int]) -> dict[str, Any]:
    """What a web process's order publisher sends (`publishing.OrderPublisher`): committed orders
    for the writer to publish with its own batches' (`SaleWriter._relayed`). Answered `ok`
    once they are in the writer's publisher."""
    return {"op": "orders", "ids": order_pks}


class OrderRelay:
    """A web process's committed orders handed to the sale writer (`orders_request`), which
    publishes them with its own (`publishing.OrderPublisher`'s relay): available while a writer
    is configured."""

    most = MAX_RELAYED
    _warned: set[str] = set()

    def available(self) -> bool:
        return client() is not None

    def __call__(self, order_pks: list[int]) -> bool:
        """False when no writer took them (the caller publishes them itself: a relay that was
        taken and not answered may then be published twice, which settles each order once
        all the same)."""
        sale_writer = client()
        if sale_writer is None:
            return False
        try:
            answer = sale_writer.ask(orders_request(order_pks))
        except (WriterUnavailable, WriterLost) as exc:
            why = str(exc)
        else:
            if answer.get("o") == "ok":
                return True
            # (no count in it: it is logged once per distinct reason)
            why = f"the sale writer refused a relay of orders: {answer.get('e')}"
        if why not in self._warned:
            self._warned.add(why)
            logger.warning("%s; publishing orders from this process meanwhile", why)
        return False


def sale_request(
    *,
    sku: str,
    cursor: str,
    rows: int,
    qty: int,
    claim: Claim | None,
    sale: dict[str, Any],
) -> dict[str, Any]:
    """What a buyer sends: the sale to take the units of (`sku`, the sale's id in `sale`, its
    `rows` stock rows: the writer names their counters itself, `keys.sale_counters`, and
    checks that its cursor is the buyer's), and the sale to write with them."""
    return {
        "sku": sku,
        "cursor": cursor,
        "rows": rows,
        "qty": qty,
        "claim": None if claim is None else [claim.key, claim.ttl_ms, claim.token],
        "sale": sale,
    }


# -- the writer's side -------------------------------------------------------------------------


@dataclass(eq=False)
class _Group:
    """The buyers one batch answered, whom the next take waits for (the linger)."""

    #: Those answered that have not sent again yet.
    waiting: set[_Connection] = field(default_factory=set)
    #: When the first of them sent again (monotonic); None before.
    first_back: float | None = None


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    closed: bool = False
    #: The batch that answered this buyer last (None before its first answer).
    group: _Group | None = None
    #: Connections handed over with requests (descriptors), not yet matched to their lines.
    fds: list[int] = field(default_factory=list)


_date: tuple[int, str] = (0, "")


def _http_date() -> str:
    """The Date header's value, made once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


@dataclass(eq=False)
class _Buyer:
    """A handed-off checkout's client connection (`HandOff`): answered once, over HTTP, then
    closed. It stands where a buyer's connection to the writer would (`_Sale.conn`)."""

    sock: socket.socket
    request: dict[str, Any]
    #: The status line's version, the Server header and the middleware's headers.
    version: str
    server: str
    headers: list[tuple[str, str]]
    closed: bool = False
    group: _Group | None = None
    #: What the socket did not take at once (`finish` sends it).
    rest: bytes = b""
    #: When the writer read it (monotonic).
    arrived: float = field(default_factory=time.monotonic)
    #: How long a `lock_request` took to get its shard's lock, in seconds.
    lock_wait: float | None = None
    #: When its web process began the checkout (monotonic: one clock for every process of
    #: the host), else when the writer read it.
    began: float = 0.0
    #: The writer's count of what it answered (`Answered.count`).
    checkouts: Answered | None = None

    @classmethod
    def of(cls, request: dict[str, Any], fd: int, checkouts: Answered | None = None) -> _Buyer:
        """The buyer of a handed-off request, on connection `fd` (which it owns from here).
        Raises ValueError for a reply it cannot answer with."""
        sock = socket.socket(fileno=fd)
        try:
            reply = request["reply"]
            headers = [(str(name), str(value)) for name, value in reply["headers"]]
            if any("\n" in name + value or "\r" in name + value for name, value in headers):
                raise ValueError("a header with a line break")
            buyer = cls(sock, request, str(reply["version"]), str(reply["server"]), headers)
        except (KeyError, TypeError, ValueError) as exc:
            sock.close()
            raise ValueError(f"a hand-off's reply: {exc!r}") from None
        sock.setblocking(False)
        buyer.began = _began(request.get("began"), buyer.arrived)
        buyer.checkouts = checkouts
        return buyer

    def respond(
        self, status: int, content: bytes, headers: Iterable[tuple[str, str]], outcome: str
    ) -> None:
        """Send the answer (its own headers, then the middleware's) and close the connection.
        What the socket does not take at once is sent by `finish` (the caller's choice of
        thread: `SaleWriter._respond`). `outcome`: `accepted` or the API's error code,
        counted with the checkout's time."""
        lines = [
            f"{self.version} {status} {HTTPStatus(status).phrase}\r\n",
            f"Server: {self.server}\r\nDate: {_http_date()}\r\nConnection: close\r\n",
        ]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        lines += [f"{name}: {value}\r\n" for name, value in self.headers]
        lines.append(f"Content-Length: {len(content)}\r\n\r\n")
        data = "".join(lines).encode("latin-1") + content
        if self.checkouts is not None:
            strategy = str(self.sale.get("served_by") or NO_STRATEGY)
            self.checkouts.count(strategy, outcome if outcome in OUTCOMES else "error", self.began)
        self.closed = True
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.sock.close()  # the client is gone; a committed sale stays committed
            return
        if sent < len(data):
            self.rest = data[sent:]
            return
        self._close()

    def finish(self, timeout: float = 5.0) -> None:
        """Send what `respond` could not at once, waiting for the client at most `timeout`."""
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(self.rest)
        except OSError:
            pass
        self._close()

    def _close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()

    @property
    def sale(self) -> dict[str, Any]:
        """The sale of a request to take (`sale_request`) or of a holder's (`write_request`)."""
        sale = self.request.get("sale") or self.request["write"]
        assert isinstance(sale, dict)
        return sale

    def created(self, answer: dict[str, Any]) -> None:
        """201: the order as `selectors.checkout_payload` renders it."""
        sale = self.sale
        payload = {
            "order": sale["public_id"],
            "sku": self.request["sku"],
            "qty": sale["qty"],
            "buyer": sale["buyer"],
            "status": "pending",
            "strategy": sale["served_by"],
            "fallback": sale["fallback"],
            "created_at": answer["at"],
        }
        headers = [
            ("Content-Type", "application/json"),
            ("Location", f"/api/orders/{sale['public_id']}"),
        ]
        if self.lock_wait is not None:
            # As the view reports a lock wait: from its arrival here until its shard was locked.
            headers.append(("Server-Timing", f"lock;dur={self.lock_wait * 1000:.2f}"))
        self.respond(201, json.dumps(payload).encode(), headers, "accepted")

    def refused(self, code: str, detail: str, status: int, headers: Iterable = ()) -> None:
        body = json.dumps({"error": code, "detail": detail}).encode()
        self.respond(status, body, [("Content-Type", "application/json"), *headers], code)


#: How far back a hand-off may say its checkout began (`HandOff.began`); older or later than
#: now, the writer counts from its own reading of it (a clock that is not this host's).
MOST_BEGUN = 60.0


def _began(value: Any, arrived: float) -> float:
    """When a handed-off checkout began, by its request's `began` where that is plausible."""
    if type(value) is float and math.isfinite(value) and arrived - MOST_BEGUN <= value <= arrived:
        return value
    return arrived


class Answered:
    """The handed-off checkouts a writer answered, by the sale's strategy and the outcome
    (`accepted` or the API's error code), and how long each took from its start in the web
    process to its answer (bucket counts over `inventory.metrics.SECONDS`, as the web
    processes' own checkout histogram): `/metrics` shows them (`shop.metrics`). The writer's
    threads answer some, so each count takes a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str], int] = {}
        #: strategy -> [count per bucket (the last: above every bound), seconds in all]
        self._seconds: dict[str, list[Any]] = {}

    def count(self, strategy: str, outcome: str, began: float) -> None:
        seconds = max(0.0, time.monotonic() - began)
        with self._lock:
            key = (strategy, outcome)
            self._outcomes[key] = self._outcomes.get(key, 0) + 1
            counts = self._seconds.setdefault(strategy, [[0] * (len(SECONDS) + 1), 0.0])
            counts[0][bisect.bisect_left(SECONDS, seconds)] += 1
            counts[1] += seconds

    @property
    def total(self) -> int:
        """How many it counted."""
        with self._lock:
            return sum(self._outcomes.values())

    def stats(self) -> dict[str, Any]:
        """{"outcomes": [[strategy, outcome, count], ...], "seconds": {strategy: {"buckets":
        [[bound, count at or below it], ..., ["+Inf", count]], "sum": seconds}}}: cumulative,
        as Prometheus's histograms are."""
        with self._lock:
            outcomes = [[*key, count] for key, count in sorted(self._outcomes.items())]
            seconds = {}
            for strategy, (counts, total) in sorted(self._seconds.items()):
                running, buckets = 0, []
                for bound, count in zip([*SECONDS, "+Inf"], counts, strict=True):
                    running += count
                    buckets.append([bound, running])
                seconds[strategy] = {"buckets": buckets, "sum": total}
        return {"outcomes": outcomes, "seconds": seconds}


@dataclass
class _Sale:
    conn: _Connection | _Buyer
    request: dict[str, Any]  # what sell_batch takes, with its rows
    #: A lock holder's locks to release once the sale is committed (`write_request`).
    release: dict[str, list[str]] | None = None
    #: The take its units came from, when one like it may be taken ahead (no claim).
    take: Take | None = None


def _ahead_key(take: Take) -> tuple[str, tuple[str, ...]]:
    return take.cursor, tuple(take.counters)


@dataclass(eq=False)
class _Ahead:
    """Units taken ahead for one sale's next requests (`SaleWriter._take_ahead`)."""

    counters: tuple[str, ...]
    #: Units held, by the index of the counter (and stock row) they came from.
    rows: dict[int, int] = field(default_factory=dict)
    #: When units were last taken into it or from it (monotonic).
    since: float = 0.0

    @property
    def units(self) -> int:
        return sum(self.rows.values())

    def serve(self, qty: int) -> dict[str, int]:
        """`qty` of its units, as a sale's rows {index: units}, lowest index first."""
        rows: dict[str, int] = {}
        needed = qty
        for index in sorted(self.rows):
            units = min(self.rows[index], needed)
            rows[str(index)] = units
            needed -= units
            if units == self.rows[index]:
                del self.rows[index]
            else:
                self.rows[index] -= units
            if not needed:
                break
        self.since = time.monotonic()
        return rows


#: Sells a checkout the direct way and renders the API's answer (`inventory.api.answer_checkout`,
#: given to the writer by whoever starts it: the API's module sits above this one).
AnswerCheckout = Callable[..., tuple[Any, str]]


class SaleWriter:
    """Serves buyers on a unix socket until `stop()`; then answers what it has taken.

    `answer`: how its threads answer a handed-off checkout its batch did not sell
    (`inventory.api.answer_checkout`); without one, such checkouts are answered `503 busy`."""

    def __init__(
        self, path: str, *, batch: int | None = None, answer: AnswerCheckout | None = None
    ) -> None:
        self.path = path
        self.answer = answer
        self.batch = batch or settings.FLASHSALE_GROUP_COMMIT_BATCH
        self.sales = 0
        self.batches = 0
        #: Orders handed to the order workers (`_hand_over`), and of those, how many web
        #: processes relayed to it (`_relayed`).
        self.handed = 0
        self.relayed = 0
        #: Publishes the orders of its batches and those relayed to it (never relays them).
        self._publisher = publishing.OrderPublisher()
        #: Lock holders' locks released after their sales' commits (`_release`).
        self.released = 0
        #: Wall and CPU seconds spent taking (the scripts) and committing: from a statement's
        #: sending to its answer (wall), and the writer's own part of that (CPU).
        self.take_seconds = self.take_cpu = 0.0
        self.commit_seconds = self.commit_cpu = 0.0
        #: The PostgreSQL backends of the writer's connections (FLASHSALE_SALE_WRITER_CONNECTIONS),
        #: the first that of the thread's own.
        self.backend_pids: list[int | None] = []
        #: The most statements it has had in flight at once.
        self.most_in_flight = 0
        #: How long to wait for the buyers of the last batch, or for a second request beside a
        #: lone one (FLASHSALE_SALE_WRITER_LINGER_US); shorter when a lock holder's sale is
        #: among them (FLASHSALE_SALE_WRITER_HOLDER_LINGER_US).
        self.linger = settings.FLASHSALE_SALE_WRITER_LINGER_US / 1_000_000
        self.holder_linger = settings.FLASHSALE_SALE_WRITER_HOLDER_LINGER_US / 1_000_000
        #: How many handed-off checkouts (`lua`'s, `segmented`'s) go without waiting the linger
        #: when no statement is in flight (FLASHSALE_SALE_WRITER_COMPANY); two, when any other
        #: request is among them.
        self.company = min(settings.FLASHSALE_SALE_WRITER_COMPANY, self.batch)
        self._selector = selectors.DefaultSelector()
        self._stopping = threading.Event()
        self._counter = StockCounter(get_redis_client())
        #: The buyers' open connections.
        self._connections: set[_Connection] = set()
        #: Requests read and not taken yet, in arrival order, and when the first arrived.
        self._pending: list[tuple[_Connection | _Buyer, dict[str, Any]]] = []
        self._pending_since = 0.0
        #: Sales taken (their units are out of Redis) and not sent yet.
        self._taken: list[_Sale] = []
        #: The batches whose statements are in flight, each with when it was sent: one at most
        #: per connection.
        self._writing: list[tuple[stock.BatchInFlight, list[_Sale], float]] = []
        #: Its database connections: the thread's own, and others made in `serve_forever`.
        self._databases: list[Any] = []
        self.connections = settings.FLASHSALE_SALE_WRITER_CONNECTIONS
        #: What it answered handed-off checkouts (`_Buyer`), and how long they took
        #: (`/metrics`); how many of them were answered the direct way.
        self.checkouts = Answered()
        self.answered_directly = 0
        #: Shards locked for handed-off `segmented` checkouts (`lock_request`), and how many of
        #: those checkouts waited for one.
        self.locked = 0
        self.lock_waits = 0
        #: Those checkouts waiting for a shard's lock, in arrival order; when they try again
        #: (at once after a batch released locks), and how long they may wait in all.
        self._lock_waiting: list[tuple[_Buyer, LockFirst]] = []
        self._lock_retry_at = 0.0
        self.lock_wait = settings.FLASHSALE_LOCK_WAIT_MS / 1000
        self.lock_ttl_ms = settings.FLASHSALE_LOCK_TTL_MS
        self._directly = ThreadPoolExecutor(DIRECT_THREADS, thread_name_prefix="sale-writer-direct")
        #: Takes and locks answered as Redis's error without a call while the breaker was open.
        self.skipped_redis = 0
        #: How long units taken ahead wait for a request (FLASHSALE_SALE_WRITER_AHEAD_MS; 0:
        #: none are); those held, by sale (its take's cursor and counters).
        self.ahead = settings.FLASHSALE_SALE_WRITER_AHEAD_MS / 1000
        self._ahead: dict[tuple[str, tuple[str, ...]], _Ahead] = {}
        #: Units taken ahead, requests served from them, units given back unused, and units
        #: dropped when Redis failed (the counters' rebuild puts those back); the scripts'
        #: wall and CPU seconds.
        self.taken_ahead = self.sold_ahead = self.returned_ahead = self.dropped_ahead = 0
        self.ahead_seconds = self.ahead_cpu = 0.0
        #: The buyers the last batch answered on their connections, whom the next batch waits
        #: for until `_hold_until` (`_holding`); None: it waits for no one. Whether it has held
        #: a request yet; the holds that held one, and how long they lasted in all.
        self._held_for: _Group | None = None
        self._hold_until = 0.0
        self._held_since = 0.0
        self._held_any = False
        self.held = 0
        self.held_seconds = 0.0

    @property
    def held_ahead(self) -> int:
        """Units taken ahead and held now: out of Redis, in no order yet. (Read from other
        threads too: the values are copied at once, under the interpreter lock.)"""
        return sum(held.units for held in list(self._ahead.values()))

    @property
    def backend_pid(self) -> int | None:
        """The PostgreSQL backend of the writer's first connection."""
        return self.backend_pids[0] if self.backend_pids else None

    # -- lifecycle ---------------------------------------------------------------------------

    def serve_forever(self, ready: Callable[[], None] | None = None) -> None:
        _open_files_to_the_hard_limit()
        listener = self._listen()
        try:
            # Made in the thread that uses them (Django checks that a connection stays there).
            self._databases = [connections[DEFAULT_DB_ALIAS]] + [
                connections.create_connection(DEFAULT_DB_ALIAS) for _ in range(self.connections - 1)
            ]
            for database in self._databases:
                with database.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    self.backend_pids.append(cursor.fetchone()[0])
            logger.debug("sale writer listening on %s", self.path)
            if ready is not None:
                ready()
            while not self._stopping.is_set():
                self._turn(listener)
            self._drain()
        finally:
            self._return_ahead(list(self._ahead))
            self._directly.shutdown(wait=True)
            self._stop_publishing()
            # Buyers still connected find the connection closed: they sell the direct way
            # until a writer listens again.
            for conn in list(self._connections):
                self._close(conn)
            self._selector.close()
            listener.close()
            for database in self._databases or [connection]:
                database.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        self._stopping.set()

    def _turn(self, listener: socket.socket) -> None:
        """Wait for something to do (a request, a connection, a statement's answer, the end
        of a linger), then do what is due: answer each batch whose statement is over (sending
        the next one first), take the requests whose turn it is, send what was taken on the
        connections that have no statement in flight."""
        for key, _ in self._selector.select(timeout=self._timeout()):
            if key.fileobj is listener:
                self._accept(listener)
            elif key.data is not None:
                if not self._pending:
                    self._pending_since = time.monotonic()
                self._pending += self._read(key.data)
        for writing in list(self._writing):
            self._poll(writing)
        if self._pending and self._due():
            self._take()
        elif self._lock_waiting and time.monotonic() >= self._lock_retry_at:
            self._lock_shards([])
        self._send_what_fits()
        if self._ahead:
            now = time.monotonic()
            self._return_ahead(
                [key for key, held in self._ahead.items() if now >= held.since + self.ahead]
            )

    def _drain(self) -> None:
        """On stop: answer the batch in flight, and take and write what has been read (a
        checkout still waiting for a shard's lock is answered busy)."""
        if self._pending:
            self._take()
        for buyer, _ in self._lock_waiting:
            self._respond(buyer, {"o": "busy"})
        self._lock_waiting = []
        while self._writing or self._taken:
            self._send_what_fits()
            if not self._writing:
                continue  # nothing could be sent: its buyers were answered
            select.select([batch.socket for batch, _, _ in self._writing], [], [], 0.1)
            for writing in list(self._writing):
                self._poll(writing)

    def _timeout(self) -> float:
        """How long the next wait may last: until the linger of a group of pending requests
        (or of a lone request) ends, or checkouts waiting for a shard's lock try again, else
        half a second (to notice `stop()`)."""
        timeout = self._pending_timeout()
        if self._lock_waiting:
            timeout = min(timeout, max(0.0, self._lock_retry_at - time.monotonic()))
        if self._ahead:
            due = min(held.since for held in self._ahead.values()) + self.ahead
            timeout = min(timeout, max(0.0, due - time.monotonic()))
        if self._held_for is not None:
            timeout = min(timeout, max(0.0, self._hold_until - time.monotonic()))
        return timeout

    def _pending_timeout(self) -> float:
        if self._pending and not self._writing and len(self._pending) < self._company():
            return max(0.0, self._pending_since + self._linger() - time.monotonic())
        if len(self._pending) < 2 or not self._writing:
            return 0.5
        linger = self._linger()
        deadlines = [
            group.first_back + linger
            for group in self._pending_groups()
            if group.waiting and group.first_back is not None
        ]
        if not deadlines:
            return 0.0
        return max(0.0, min(deadlines) - time.monotonic())

    def _linger(self) -> float:
        """How long the pending requests wait for company: the holders' linger when a lock
        holder's sale is among them (its shard is locked meanwhile), else the linger."""
        if any("write" in request for _, request in self._pending):
            return self.holder_linger
        return self.linger

    def _company(self) -> int:
        """How many pending requests go at once when no statement is in flight (fewer wait
        the linger from the first): `company` when they are all handed-off checkouts (`lua`'s,
        and `segmented`'s, whose shards are locked only once they are taken), else two. A web
        process hands a checkout off and serves other requests; no group of buyers comes back
        together, so a batch is what arrived meanwhile, and each pays a script and a
        statement: at the pace two cores sell over HTTP, two or three checkouts' worth, when a
        few more arrive within the linger."""
        if all(isinstance(conn, _Buyer) and "sale" in request for conn, request in self._pending):
            return self.company
        return 2

    def _pending_groups(self) -> set[_Group]:
        return {conn.group for conn, _ in self._pending if conn.group is not None}

    def _due(self) -> bool:
        """Whether to take the pending requests now: when no statement is in flight (the
        database waits for them); else, when there are several, once each buyer answered with
        any of them has sent again (or gone), or the linger since the first of them did is
        over. A lone request waits for the statement in flight: whatever arrives meanwhile is
        taken with it, in one script, into one batch (one web process of many, with other
        requests to serve in between, rarely comes back with its group). Not while the next
        batch waits for the last one's buyers (`_holding`), and at once when a batch taken is
        about to go: whatever has arrived goes with it."""
        if len(self._pending) >= self.batch:
            return True
        if self._holding():
            return False
        if self._taken and len(self._writing) < len(self._databases):
            return True
        linger = self._linger()
        if not linger:
            return True
        if not self._writing:
            # A lone request waits a moment for company (the next checkout is often on
            # its way); two or more go at once, the database waits (handed-off checkouts:
            # `_company` of them).
            return (
                len(self._pending) >= self._company()
                or time.monotonic() >= self._pending_since + linger
            )
        if len(self._pending) < 2:
            return False
        now = time.monotonic()
        for group in self._pending_groups():
            group.waiting = {conn for conn in group.waiting if not conn.closed}
            back = group.first_back
            if group.waiting and back is not None and now < back + linger:
                return False
        return True

    def _listen(self) -> socket.socket:
        if os.path.exists(self.path):
            if not stat.S_ISSOCK(os.stat(self.path).st_mode):
                raise RuntimeError(f"{self.path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)  # left by a writer that died
            else:
                raise RuntimeError(f"another sale writer is listening on {self.path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(1024)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        return listener

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        sock.settimeout(5.0)  # answers are small; a buyer that stops reading is dropped
        conn = _Connection(sock)
        self._connections.add(conn)
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Connection) -> None:
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.closed = True
        conn.group = None
        for fd in conn.fds:  # handed over with lines that never came whole
            os.close(fd)
        conn.fds.clear()
        self._connections.discard(conn)

    def _read(self, conn: _Connection) -> list[tuple[_Connection | _Buyer, dict[str, Any]]]:
        try:
            data, ancillary, flags, _ = conn.sock.recvmsg(MAX_LINE, socket.CMSG_SPACE(MAX_FDS * 4))
        except OSError:
            data, ancillary, flags = b"", [], 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                conn.fds.extend(fds)
        if not data or flags & socket.MSG_CTRUNC:
            if data:
                logger.error("sale writer: a buyer sent more connections than it can take")
            self._close(conn)
            return []
        conn.buffer += data
        arrived: list[tuple[_Connection | _Buyer, dict[str, Any]]] = []
        while True:
            end = conn.buffer.find(b"\n")
            if end < 0:
                if len(conn.buffer) > MAX_LINE:
                    self._close(conn)
                break
            raw = bytes(conn.buffer[:end])
            del conn.buffer[: end + 1]
            try:
                request = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                self._answer(conn, {"o": "invalid", "e": f"not JSON: {exc}"})
                continue
            if not isinstance(request, dict):
                self._answer(conn, {"o": "invalid", "e": "not an object"})
                continue
            if request.get("op") == "stats":
                self._answer(conn, self.stats())
                continue
            if request.get("op") == "orders":
                self._answer(conn, self._relayed(request.get("ids")))
                continue
            if "reply" in request:
                # A hand-off: its connection came with it. One without is a broken stream:
                # nothing more on it can be matched to its connection.
                if not conn.fds:
                    logger.error("sale writer: a hand-off came without its connection")
                    self._close(conn)
                    return arrived
                try:
                    buyer = _Buyer.of(request, conn.fds.pop(0), self.checkouts)
                except ValueError as exc:
                    logger.error("sale writer: %s", exc)
                    self._close(conn)
                    return arrived
                arrived.append((buyer, request))
                continue
            group = conn.group
            if group is not None:
                group.waiting.discard(conn)
                if group.first_back is None:
                    group.first_back = time.monotonic()
            arrived.append((conn, request))
        return arrived

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "backend_pid": self.backend_pid,
            "backend_pids": self.backend_pids,
            "most_in_flight": self.most_in_flight,
            "sales": self.sales,
            "batches": self.batches,
            "handed": self.handed,
            "relayed": self.relayed,
            "released": self.released,
            "take_seconds": self.take_seconds,
            "take_cpu_seconds": self.take_cpu,
            "commit_seconds": self.commit_seconds,
            "commit_cpu_seconds": self.commit_cpu,
            "answered": self.checkouts.total,
            "answered_directly": self.answered_directly,
            "locked": self.locked,
            "lock_waits": self.lock_waits,
            "skipped_redis": self.skipped_redis,
            "taken_ahead": self.taken_ahead,
            "held_ahead": self.held_ahead,
            "sold_ahead": self.sold_ahead,
            "returned_ahead": self.returned_ahead,
            "dropped_ahead": self.dropped_ahead,
            "ahead_seconds": self.ahead_seconds,
            "ahead_cpu_seconds": self.ahead_cpu,
            "held": self.held,
            "held_seconds": self.held_seconds,
            "checkouts": self.checkouts.stats(),
        }

    def _answer(self, conn: _Connection | _Buyer, answer: dict[str, Any]) -> None:
        if isinstance(conn, _Buyer):
            self._respond(conn, answer)
            return
        try:
            conn.sock.sendall(_line(answer))
        except OSError:
            pass  # the buyer is gone; its sale, if written, is in the database all the same

    def _respond(self, buyer: _Buyer, answer: dict[str, Any]) -> None:
        """Answer a handed-off checkout: sold and sold out here, anything else the way a web
        process would, in one of the writer's threads."""
        outcome = answer["o"]
        if outcome == "sold":
            buyer.created(answer)
        elif outcome == "sold_out":
            refusal = SoldOut(
                sku=buyer.request["sku"],
                requested=buyer.request["qty"],
                remaining=answer.get("remaining"),
            )
            buyer.refused(refusal.code, refusal.detail, refusal.status)
        elif outcome == "invalid":
            # Not sold the direct way here either: the writer's own settings (its key prefix,
            # say) are what the request disagreed with. Said as a buyer waiting is told.
            detail = f"the sale writer refused the request: {answer.get('e')}"
            _warn_once(detail)
            buyer.refused("error", detail, 500)
        else:
            self.answered_directly += 1
            if "write" in buyer.request:
                # Here, not in the thread: the threads' own checkouts may wait for these
                # locks, and a release queued behind them would come too late.
                self._release_holder(buyer.request.get("release"))
            self._directly.submit(self._answer_directly, buyer, answer)
            return
        if buyer.rest:
            self._directly.submit(buyer.finish)

    def _answer_directly(self, buyer: _Buyer, answer: dict[str, Any]) -> None:
        """A handed-off checkout the batch did not sell (in one of the writer's threads; a
        shard holder's locks were released already, `_respond`). A batch that failed may have
        committed it: that is answered `503 busy` (a retry finds the order by its key, if it
        has one), as a waiting buyer is. Otherwise the units a take got go back, and it is sold
        the direct way, the answer being the API's."""
        request = buyer.request
        try:
            close_old_connections()
            if "write" not in request and answer["o"] != "failed":
                self._give_back(request, answer.get("rows"))
            if answer["o"] in ("failed", "busy") or self.answer is None:
                if answer["o"] == "busy":  # as a holder's wait that ran out is answered
                    detail = f"{request['sku']}: every shard holding {request['qty']} stayed locked"
                else:
                    why = "its batch failed" if answer["o"] == "failed" else "it cannot sell it"
                    detail = f"{request['sku']}: the sale writer did not sell it ({why})"
                busy = Busy(detail, retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER)
                retry = [("Retry-After", str(busy.retry_after))]
                buyer.refused(busy.code, busy.detail, busy.status, retry)
            else:
                with direct_only():
                    response, outcome = self.answer(
                        sku=request["sku"],
                        qty=request["qty"],
                        buyer=buyer.sale["buyer"],
                        idempotency_key=buyer.sale.get("key"),
                    )
                buyer.respond(response.status_code, response.content, response.items(), outcome)
            if buyer.rest:
                buyer.finish()
        except Exception:
            logger.exception("sale writer: a handed-off checkout could not be answered")
            buyer.refused("error", "the checkout failed in the sale writer", 500)
            if buyer.rest:
                buyer.finish()
        finally:
            # A rare path: its connections are not kept (the writer's own stay its only ones).
            connections.close_all()

    def _release_holder(self, release: Any) -> None:
        """Release a handed-off holder's locks ({index: [name, token, hint]}) by its tokens,
        each to its first waiter, leaving the hints as they are (a hint too high is corrected
        by the next sale the database refuses). A lock no longer held by that token is left
        alone. When Redis fails (or is known down), the locks are remembered as in doubt: the
        breaker's recovery releases them once Redis answers, if still theirs (else they expire)."""
        if not release:
            return
        locks = [(name, token.encode()) for name, token, _ in release.values()]
        if self._redis_down():
            remember_unsettled(locks)
            return
        for place, (name, token) in enumerate(locks):
            lock = Lock(self._counter.redis, name)
            lock.local.token = token
            try:
                lock.release()
            except LockError:
                pass  # expired, or released already
            except REDIS_DOWN_ERRORS as exc:
                # The rest would each wait out the same timeout: all are left to the recovery.
                redis_breaker.record_failure(exc)
                remember_unsettled(locks[place:])
                logger.warning(
                    "sale writer: could not release %s (%s)",
                    ", ".join(n for n, _ in locks[place:]),
                    exc,
                )
                return

    def _redis_down(self) -> bool:
        """Whether Redis is known down: this process's breaker is open. Then the loop calls no
        script; once the breaker's wait is over, its probe (a ping, then what a recovered Redis
        needs: `inventory.breaker`) runs in a thread of its own, which closes it."""
        return not redis_breaker.allow()

    def _skip_redis(self, conns: Sequence[_Connection | _Buyer]) -> None:
        """Answer requests Redis is known down for, with no call (`BREAKER_OPEN`)."""
        self.skipped_redis += len(conns)
        self._answer_redis_down(conns, BREAKER_OPEN)

    def _answer_redis_down(self, conns: Iterable[_Connection | _Buyer], why: str) -> None:
        """Redis's error, for requests of which nothing was taken or locked: their buyers'
        fallback serves them (a handed-off checkout's, in a thread: `_respond`)."""
        for conn in conns:
            self._answer(conn, {"o": "redis_down", "e": why})

    def _give_back(self, request: dict[str, Any], rows: dict[str, int] | None) -> None:
        """The units a take got for a request the batch did not sell, back to their counters."""
        if not rows:
            return
        _, counters = keys.sale_counters(request["sku"], request["sale"]["sale"], request["rows"])
        try:
            self._counter.give_back_many({counters[int(i)]: units for i, units in rows.items()})
        except REDIS_DOWN_ERRORS as exc:
            # Low until the counters are rebuilt from the database, as after any outage.
            logger.warning("sale writer: could not give %s units back (%s)", rows, exc)

    # -- a batch: its units from Redis in one script, its sales in one statement -------------

    def _take(self) -> None:
        """Take the units of every pending request in one script; those that got units wait
        in `_taken` for their statement, the others are answered now."""
        arrived, self._pending = self._pending, []
        takes: list[tuple[_Connection | _Buyer, dict[str, Any], Take]] = []
        to_lock: list[tuple[_Buyer, LockFirst]] = []
        for conn, request in arrived:
            if "lock" in request:  # a `segmented` checkout handed off: lock a shard for it
                try:
                    if not isinstance(conn, _Buyer):
                        raise ValueError("a lock request comes with its client's connection")
                    to_lock.append((conn, _lock_of(request, self.lock_ttl_ms)))
                except (KeyError, TypeError, ValueError) as exc:
                    self._answer(conn, {"o": "invalid", "e": repr(exc)})
                continue
            if "write" in request:  # a lock holder's sale: its units are its rows' already
                try:
                    self._taken.append(_Sale(conn, *_write_of(request)))
                except (KeyError, TypeError, ValueError) as exc:
                    self._answer(conn, {"o": "invalid", "e": repr(exc)})
                continue
            try:
                take = _take_of(request)
            except (KeyError, TypeError, ValueError) as exc:
                self._answer(conn, {"o": "invalid", "e": repr(exc)})
                continue
            takes.append((conn, request, take))
        if to_lock or self._lock_waiting:
            self._lock_shards(to_lock)
        if not takes:
            return
        if self._redis_down():
            self._drop_ahead()
            self._skip_redis([conn for conn, _, _ in takes])
            return
        takes = self._serve_ahead(takes)
        results = self._take_units(takes)
        if results is None:
            return
        # Sold out while units of the sale are held ahead (too few for the request): they go
        # back, and the request is taken again, so that no buyer hears `sold_out` while the
        # writer holds units of the sale.
        short = [
            place
            for place, (_, _, take) in enumerate(takes)
            if results[place] == {} and _ahead_key(take) in self._ahead
        ]
        if short:
            self._return_ahead({_ahead_key(takes[place][2]) for place in short})
            again = self._take_units([takes[place] for place in short])
            if again is None:  # answered: Redis failed
                takes = [take for place, take in enumerate(takes) if place not in short]
                results = [result for place, result in enumerate(results) if place not in short]
            else:
                for place, result in zip(short, again, strict=True):
                    results[place] = result
        for (conn, request, take), result in zip(takes, results, strict=True):
            if isinstance(result, Claim):
                self._answer(conn, {"o": "claimed"})
            elif result is None:
                self._answer(conn, {"o": "missing"})
            elif not result:
                self._answer(conn, {"o": "sold_out"})
            else:
                rows = {str(index): units for index, units in result.items()}
                self._taken.append(
                    _Sale(conn, {**request["sale"], "rows": rows}, take=_aheadable(take))
                )

    def _take_units(
        self, takes: list[tuple[_Connection | _Buyer, dict[str, Any], Take]]
    ) -> list[dict[int, int] | None | Claim] | None:
        """The takes' units from Redis, in one script; None when it failed (its requests
        answered)."""
        if not takes:
            return []
        started = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            return self._counter.take_spread_many([take for _, _, take in takes])
        except REDIS_DOWN_ERRORS as exc:
            # Nothing of these requests is written, and none will be: the buyers' fallback
            # may serve them. Units the script took before the failure come back when the
            # counters are rebuilt from the database, as after any outage.
            redis_breaker.record_failure(exc)
            self._drop_ahead()
            self._answer_redis_down([conn for conn, _, _ in takes], exc.__class__.__name__)
        except (ResponseError, ValueError) as exc:
            for conn, _, _ in takes:
                self._answer(conn, {"o": "error", "e": str(exc)})
        finally:
            self.take_seconds += time.perf_counter() - started
            self.take_cpu += time.thread_time() - cpu0
        return None

    # -- units taken ahead ---------------------------------------------------------------------

    def _serve_ahead(
        self, takes: list[tuple[_Connection | _Buyer, dict[str, Any], Take]]
    ) -> list[tuple[_Connection | _Buyer, dict[str, Any], Take]]:
        """Serve the takes that units held ahead for their sale cover (no claim to set);
        the others, to take from Redis."""
        if not self._ahead:
            return takes
        rest = []
        for conn, request, take in takes:
            held = self._ahead.get(_ahead_key(take)) if take.claim is None else None
            if held is None or held.units < take.qty:
                rest.append((conn, request, take))
                continue
            rows = held.serve(take.qty)
            if not held.units:
                del self._ahead[_ahead_key(take)]
            self.sold_ahead += 1
            self._taken.append(_Sale(conn, {**request["sale"], "rows": rows}, take=take))
        return rest

    def _take_ahead(self, sales: list[_Sale]) -> None:
        """Right after a batch's statement is sent: take, for each sale, as many units as the
        batch sells of it to buyers on their connections and the requests of such buyers
        waiting to be taken ask (less those still held), for the requests its buyers will send
        once answered, in one script, while PostgreSQL writes the batch.
        Nothing is taken ahead once the writer is stopping."""
        if not self.ahead or self._stopping.is_set():
            return
        wanted: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        for sale in sales:
            # Only for a buyer that sends its next request on its connection: a handed-off
            # checkout's client is answered directly, and the next checkout comes from a web
            # process in a time of its own, like a lone request (over HTTP, the host busy all
            # the time, the script ahead for them bought nothing: docs/design.md).
            if sale.take is not None and isinstance(sale.conn, _Connection):
                entry = wanted.setdefault(_ahead_key(sale.take), [sale.take, 0])
                entry[1] += sale.take.qty
        # Requests read and not taken yet (those that came back while a batch was held, or
        # during a statement on another connection) will be served from what is held first:
        # taken for as well.
        for conn, request in self._pending:
            if not isinstance(conn, _Connection):
                continue
            cursor, qty = request.get("cursor"), request.get("qty")
            if request.get("claim") is not None or type(qty) is not int or qty < 1:
                continue
            for key, entry in wanted.items():
                if key[0] == cursor:
                    entry[1] += qty
        takes = []
        for key, (take, units) in wanted.items():
            held = self._ahead.get(key)
            units -= held.units if held else 0
            if units > 0:
                takes.append(Take(take.cursor, take.counters, units))
        if not takes or self._redis_down():
            return
        started = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            results = self._counter.take_spread_many(takes)
        except REDIS_DOWN_ERRORS as exc:
            redis_breaker.record_failure(exc)
            self._drop_ahead()
            return
        except (ResponseError, ValueError) as exc:
            logger.warning("sale writer: could not take units ahead (%s)", exc)
            return
        finally:
            self.ahead_seconds += time.perf_counter() - started
            self.ahead_cpu += time.thread_time() - cpu0
        now = time.monotonic()
        for take, result in zip(takes, results, strict=True):
            if not isinstance(result, dict) or not result:
                continue  # too few left (or the sale gone): its requests take from Redis
            key = _ahead_key(take)
            held = self._ahead.setdefault(key, _Ahead(key[1]))
            for index, units in result.items():
                held.rows[index] = held.rows.get(index, 0) + units
                self.taken_ahead += units
            held.since = now

    def _return_ahead(self, keys_: Iterable[tuple[str, tuple[str, ...]]]) -> None:
        """Give the units held ahead for these sales back to their counters."""
        amounts: dict[str, int] = {}
        for key in keys_:
            held = self._ahead.pop(key, None)
            if held is None:
                continue
            for index, units in held.rows.items():
                amounts[held.counters[index]] = amounts.get(held.counters[index], 0) + units
        if not amounts:
            return
        if self._redis_down():
            self.dropped_ahead += sum(amounts.values())
            return
        try:
            self._counter.give_back_many(amounts)
        except REDIS_DOWN_ERRORS as exc:
            # Low until the counters are rebuilt from the database, as after any outage.
            redis_breaker.record_failure(exc)
            self.dropped_ahead += sum(amounts.values())
            logger.warning("sale writer: could not give units held ahead back (%s)", exc)
            return
        self.returned_ahead += sum(amounts.values())

    def _drop_ahead(self) -> None:
        """Forget the units held ahead, Redis having failed: its counters are rebuilt from the
        database once it is back, which holds them still."""
        for held in self._ahead.values():
            self.dropped_ahead += held.units
        self._ahead.clear()

    def _lock_shards(self, arrived: list[tuple[_Buyer, LockFirst]]) -> None:
        """Lock a shard for each handed-off `segmented` checkout (`lock_request`), those waiting
        first, then those just `arrived`, in one round trip (a script each, in that order).
        One that got its lock joins the taken sales as its holder's would (`write_request`):
        fenced by the lock's token, the lock released with its commit. The others: sold out
        when the hints hold fewer units than asked; sold the direct way (in a thread) when no
        shard holds them all, or the hints are missing; else (every shard holding them is
        locked) it waits for the next release, answered busy once FLASHSALE_LOCK_WAIT_MS since
        its arrival is over, as a holder's wait is."""
        now = time.monotonic()
        waiting, self._lock_waiting = self._lock_waiting, []
        self._lock_retry_at = now + LOCK_RETRY
        candidates: list[_Buyer] = []
        calls: list[LockFirst] = []
        for buyer, call in (*waiting, *arrived):
            if now >= buyer.arrived + self.lock_wait:
                self._respond(buyer, {"o": "busy"})
            else:
                candidates.append(buyer)
                calls.append(call)
        if not candidates:
            return
        if self._redis_down():
            self._skip_redis(candidates)
            return
        counted = {buyer for buyer, _ in waiting}  # their waits are counted already
        started = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            results = self._counter.lock_first_holding_many(calls)
        except REDIS_DOWN_ERRORS as exc:
            # Locks a script took before the failure expire with their lifetime: no token of
            # theirs is known to anyone but this call. The checkouts go to the fallback.
            redis_breaker.record_failure(exc)
            self._answer_redis_down(candidates, exc.__class__.__name__)
            return
        except (ResponseError, ValueError) as exc:
            for buyer in candidates:
                self._respond(buyer, {"o": "error", "e": str(exc)})
            return
        finally:
            self.take_seconds += time.perf_counter() - started
            self.take_cpu += time.thread_time() - cpu0
        now = time.monotonic()
        for buyer, call, (picked, hints, fence) in zip(candidates, calls, results, strict=True):
            if picked is None:
                self._respond(buyer, {"o": "missing"})
            elif sum(hints) < call.qty:
                self._respond(buyer, {"o": "sold_out", "remaining": sum(hints)})
            elif picked >= 0 and fence is not None:
                index = str(picked)
                rows, fences = {index: call.qty}, {index: fence}
                write = {**buyer.request["sale"], "rows": rows, "fences": fences}
                release = {index: [call.locks[picked], call.token, call.counters[picked]]}
                buyer.request = {**buyer.request, "write": write, "release": release}
                buyer.lock_wait = now - buyer.arrived
                self.locked += 1
                self._taken.append(_Sale(buyer, {**write, "levels": True}, release))
            elif max(hints) < call.qty:
                self._respond(buyer, {"o": "spread"})  # the direct way locks several shards
            else:
                if buyer not in counted:
                    self.lock_waits += 1
                self._lock_waiting.append((buyer, call))

    def _send_what_fits(self) -> None:
        """Send what was taken, a batch on each connection with no statement in flight (unless
        it waits for the buyers the last batch answered)."""
        while self._taken and not self._holding():
            busy = [batch.database for batch, _, _ in self._writing]
            free = [database for database in self._databases if database not in busy]
            if not free:
                return
            self._send(free[0])

    def _send(self, database: Any) -> None:
        """Send the statement of (up to a batch of) the taken sales on `database`, without
        waiting for it."""
        sales, self._taken = self._taken[: self.batch], self._taken[self.batch :]
        # Batches lock rows in one order (lowest first), so that two writers on one database
        # do not deadlock.
        sales.sort(key=lambda sale: min(map(int, sale.request["rows"])))
        started = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            batch = stock.BatchInFlight([sale.request for sale in sales], database)
        except Exception:
            logger.exception("sale writer: a batch of %d sales could not be sent", len(sales))
            self._reset_connection(database)
            self._answer_batch(sales, [{"o": "failed"}] * len(sales))
            return
        finally:
            self.commit_cpu += time.thread_time() - cpu0
        # A new backend after a lost connection.
        self.backend_pids[self._databases.index(database)] = batch.backend_pid
        self._selector.register(batch.socket, selectors.EVENT_READ, None)
        self._writing.append((batch, sales, started))
        self.most_in_flight = max(self.most_in_flight, len(self._writing))
        self._take_ahead(sales)

    def _poll(self, writing: tuple[stock.BatchInFlight, list[_Sale], float]) -> None:
        """Read a statement's answer; once it is over, send the next batch (unless it waits
        for this one's buyers, `_hold`), then answer this one's buyers."""
        batch, sales, started = writing
        cpu0 = time.thread_time()
        try:
            if not batch.poll():
                return
            answers = batch.answers()
        except stock.RowLockTimeout:
            answers = [{"o": "locked"}] * len(sales)
        except Exception:
            # May or may not be committed (a connection lost mid-commit): the buyers answer
            # busy, and a retry with the idempotency key finds what was written.
            logger.exception("sale writer: a batch of %d sales failed", len(sales))
            answers = [{"o": "failed"}] * len(sales)
            self._unregister(batch.socket)
            self._reset_connection(batch.database)
        finally:
            self.commit_cpu += time.thread_time() - cpu0
        took = time.perf_counter() - started
        self.commit_seconds += took
        self._writing.remove(writing)
        self._unregister(batch.socket)
        group = _Group()
        self._hold(sales, took, group)
        if self._held_for is None:
            self._send_what_fits()  # the database's turn again before the buyers' (they can wait)
        cpu0 = time.thread_time()
        released = self._release(sales, answers)
        self._answer_batch(sales, answers, released, group)
        self.commit_cpu += time.thread_time() - cpu0

    def _hold(self, sales: list[_Sale], took: float, group: _Group) -> None:
        """Hold the next batch (what was taken meanwhile, and what arrives) for the buyers of
        the batch just over who send again on their connections, for as long as its statement
        took at most: back by then, they go in the same batch, and one statement serves them
        and those who were waiting. (Sent at once instead, two groups of buyers take turns,
        each waiting for the other's statement and then its own.) A web process serving a
        crowd comes back later than that: its request is held no longer than a statement.
        Handed-off checkouts send nothing again: nothing is held for them."""
        if self._stopping.is_set() or not any(isinstance(sale.conn, _Connection) for sale in sales):
            return
        if self._held_for is not None:  # another batch's buyers (with several connections)
            self._end_hold(time.monotonic())
        self._held_for = group
        self._held_since = time.monotonic()
        self._hold_until = self._held_since + took
        self._held_any = False

    def _holding(self) -> bool:
        """Whether the batch taken waits for the buyers of the last one (`_hold`): until they
        are all back, or it has waited as long as their statement took."""
        group = self._held_for
        if group is None:
            return False
        now = time.monotonic()
        if (
            now < self._hold_until
            and len(self._taken) + len(self._pending) < self.batch
            and not self._stopping.is_set()
            and any(not conn.closed for conn in group.waiting)
        ):
            self._held_any = self._held_any or bool(self._taken or self._pending)
            return True
        self._end_hold(now)
        return False

    def _end_hold(self, now: float) -> None:
        self._held_for = None
        if self._held_any:
            self.held += 1
            self.held_seconds += now - self._held_since

    def _release(self, sales: list[_Sale], answers: list[dict[str, Any]]) -> dict[int, list[str]]:
        """Release the locks of the holders whose sales were committed, as they asked, each with
        its row's level copied to its hint, in one script call; {sale's place in the batch: the
        indexes of its rows whose locks were released}. A holder's own release would wait for
        its process to be woken and run, its shard locked meanwhile. When Redis fails, none
        is: the holders release their locks themselves (a release that ran finds its token
        gone and does nothing)."""
        released: dict[int, list[str]] = {}
        releases = []
        for place, (sale, answer) in enumerate(zip(sales, answers, strict=True)):
            if sale.release is None or answer["o"] != "sold":
                continue
            for index, (name, token, hint) in sale.release.items():
                left, version = answer["levels"][index]
                _, hint_keys, hint_args = StockCounter.set_newer_call({hint: (left, version)})
                releases.append((name, token, hint_keys, hint_args))
                released.setdefault(place, []).append(index)
        if not releases or self._redis_down():
            return {}
        source, keys_, args = release_each_call(scripts.STOCK_SET_NEWER, releases)
        client = self._counter.redis
        try:
            scripts.script_for(client, source)(keys=keys_, args=args)
        except _RELEASE_ERRORS as exc:
            if isinstance(exc, REDIS_DOWN_ERRORS):
                redis_breaker.record_failure(exc)
            logger.warning("sale writer: could not release %d locks (%s)", len(releases), exc)
            return {}
        self.released += len(releases)
        self._lock_retry_at = 0.0  # shards are free: those waiting for one try at once
        return released

    def _answer_batch(
        self,
        sales: list[_Sale],
        answers: list[dict[str, Any]],
        released: dict[int, list[str]] | None = None,
        group: _Group | None = None,
    ) -> None:
        """Answer each buyer of a batch; those who will send again on their connections join
        `group` (the next take waits for them)."""
        self.batches += 1
        if group is None:
            group = _Group()
        sold = [answer["id"] for answer in answers if answer["o"] == "sold"]
        self.sales += len(sold)
        for place, (sale, answer) in enumerate(zip(sales, answers, strict=True)):
            if answer["o"] == "sold":
                answer = {**answer, "handed": True}
                if released and place in released:
                    answer["released"] = released[place]
            self._answer(sale.conn, {**answer, "rows": sale.request["rows"]})
            # (A handed-off checkout's connection is answered once: it sends nothing again.)
            if isinstance(sale.conn, _Connection) and not sale.conn.closed:
                sale.conn.group = group
                group.waiting.add(sale.conn)
        if sold:
            self._hand_over(sold)

    def _unregister(self, fd: int) -> None:
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _reset_connection(self, database: Any) -> None:
        close_old_connections()
        if database.connection is not None and not database.is_usable():
            database.close()

    def _hand_over(self, order_pks: list[int]) -> bool:
        """Committed orders to the order workers (`publishing.hand_over`, through the writer's
        own publisher): one process publishing every web process's orders sends fewer, larger
        messages, which the workers settle in fewer, larger batches, and the web processes
        publish none. A publish that fails leaves the orders pending, for the sweeper, as a web
        process's. False when they could not even be queued for publishing."""
        try:
            publishing.hand_over(order_pks, self._publisher)
        except Exception:
            logger.exception("sale writer: %d orders not handed to the workers", len(order_pks))
            return False
        self.handed += len(order_pks)
        return True

    def _relayed(self, order_pks: Any) -> dict[str, Any]:
        """A web process's committed orders (`orders_request`), to publish with the batches'."""
        if (
            not isinstance(order_pks, list)
            or not 0 < len(order_pks) <= MAX_RELAYED
            or not all(type(pk) is int and pk > 0 for pk in order_pks)
        ):
            return {"o": "invalid", "e": f"ids: from 1 to {MAX_RELAYED} order keys"}
        if not self._hand_over(order_pks):
            return {"o": "error", "e": "the orders could not be queued for publishing"}
        self.relayed += len(order_pks)
        return {"o": "ok"}

    def _stop_publishing(self) -> None:
        """Send what the writer's publisher holds, and end its thread."""
        try:
            self._publisher.stop()
        except Exception:
            logger.exception("sale writer: publishing its last orders failed")


def _open_files_to_the_hard_limit() -> None:
    """Let the writer hold as many descriptors as it may: each handed-off checkout's client
    connection is one until it is answered (a read that finds no room for the descriptors it
    carries closes the web process's connection, and with it those checkouts)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            logger.warning("sale writer: open files stay at %d (%s)", soft, exc)


def take_priority(nice: int) -> str | None:
    """Run this process at niceness `nice` (FLASHSALE_SALE_WRITER_NICE), before it starts any
    thread (Linux keeps a niceness per thread; new ones inherit it). None when done; else why
    not, for the caller to warn with: the writer then runs at the niceness it has.

    Every `lua` sale waits on the writer's one thread. Sharing a few cores with the web
    workers, a writer woken by a statement's answer otherwise waits behind them for a CPU, and
    the next batch with it (docs/design.md, "The writer's turn on shared cores")."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        return (
            f"could not set the sale writer's niceness to {nice} (lowering it needs root, "
            f"CAP_SYS_NICE or an RLIMIT_NICE, `ulimit -e`, of at least {20 - nice}): it runs at "
            f"{os.getpriority(os.PRIO_PROCESS, 0)}"
        )
    return None


def _write_of(request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]] | None]:
    """The sale a lock holder's request asks to write (`write_request`), checked: its rows
    ({index: units}, units above 0) and their fencing tokens; and the locks to release after
    it, {index: [name, token, hint]}, each of a row it writes. Raises KeyError, TypeError or
    ValueError for one that is not well formed."""
    release = request.get("release")
    if release is not None:
        if not isinstance(release, dict):
            raise ValueError("release names {index: [lock, token, hint]}")
        for index, held in release.items():
            if (
                not isinstance(held, list)
                or len(held) != 3
                or not all(isinstance(part, str) and part for part in held)
            ):
                raise ValueError(f"release of row {index!r}: {held!r}")
    sale = request["write"]
    if not isinstance(sale, dict) or type(sale.get("sale")) is not int:
        raise ValueError("no sale to write")
    rows, fences = sale["rows"], sale.get("fences") or {}
    if not isinstance(rows, dict) or not rows or not isinstance(fences, dict):
        raise ValueError("a write names its rows, {index: units}, and their fences")
    for index, units in rows.items():
        if not index.isdigit() or type(units) is not int or units < 1:
            raise ValueError(f"row {index!r}: {units!r} units")
    for index, fence in fences.items():
        if index not in rows or type(fence) is not int:
            raise ValueError(f"fence {fence!r} for row {index!r}")
    for index in release or {}:
        if index not in rows:
            raise ValueError(f"release of row {index!r}, which the sale does not write")
    return {**sale, "levels": True}, release or None


def _aheadable(take: Take) -> Take | None:
    """The take, when one like it may be taken ahead: it sets no claim."""
    return take if take.claim is None else None


def _take_of(request: dict[str, Any]) -> Take:
    """The take a request asks for. Raises KeyError, TypeError or ValueError for a request that
    names no sale, or whose cursor is not the one this writer names for it (the buyer's
    processes and the writer disagree on the key prefix: nothing must be taken)."""
    sale = request["sale"]
    if not isinstance(sale, dict):
        raise ValueError("no sale to write")
    sku, sale_id, rows = request["sku"], sale["sale"], request["rows"]
    if not isinstance(sku, str) or type(sale_id) is not int or type(rows) is not int:
        raise ValueError("a sale is named by its sku, the sale's id and its number of rows")
    cursor, counters = keys.sale_counters(sku, sale_id, rows)
    if request["cursor"] != cursor:
        raise ValueError(
            f"the buyer's counters are not this writer's ({request['cursor']!r}, not "
            f"{cursor!r}): do they share FLASHSALE_REDIS_PREFIX?"
        )
    claim = None if request.get("claim") is None else Claim(*request["claim"])
    return Take(cursor, counters, request["qty"], claim)


def _lock_of(request: dict[str, Any], ttl_ms: int) -> LockFirst:
    """What to lock for a `lock_request`: its sale's shards' hints and locks, from its `start`,
    with a token of the writer's. Raises KeyError, TypeError or ValueError for one that is not
    well formed."""
    sale, lock = request["sale"], request["lock"]
    if not isinstance(sale, dict) or not isinstance(lock, dict):
        raise ValueError("a lock request names its sale and its shards")
    sku, sale_id, qty = request["sku"], sale["sale"], sale["qty"]
    shards, start = lock["shards"], lock["start"]
    if not isinstance(sku, str) or not all(type(n) is int for n in (sale_id, shards, start, qty)):
        raise ValueError("a sale is named by its sku, the sale's id and its number of shards")
    if not 1 <= shards <= MAX_SHARDS or not 0 <= start < shards:
        raise ValueError(f"shard {start} of {shards}")
    if qty < 1 or request["qty"] != qty:
        raise ValueError(f"{request['qty']!r} units asked, {qty!r} to write")
    hints, locks = keys.shard_keys(sku, sale_id, shards)
    if lock["name"] != locks[start]:
        raise ValueError(
            f"the buyer's shard locks are not this writer's ({lock['name']!r}, not "
            f"{locks[start]!r}): do they share FLASHSALE_REDIS_PREFIX?"
        )
    return LockFirst(hints, locks, qty, start, uuid.uuid4().hex, ttl_ms)
