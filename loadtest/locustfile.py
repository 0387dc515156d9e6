"""A flash crowd of buyers for Locust, as `manage.py loadtest` runs it or on its own.

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \
        --sku phone --strategy lua -u 50 -r 50 -t 20s

Each user is one buyer with a unique id who looks at the item now and then and checks out as
fast as the shop answers; a tenth of the crowd comes first and only looks, the whole crowd
gathers a moment before the opening and buys from then on (`FlashCrowd`). `201` and the `409`s
a flash sale answers (`CORRECT_CONFLICTS`) are successes, anything else a failure; `sold_out`
answers count apart (`checkout sold out`), and each unit sold and each lock wait (from
Server-Timing) go into Locust's stats as `UNITS sold` and `LOCK wait`. Invariant: at the end
the run audits the sale over HTTP and exits 3 if it oversold, unless `--allow-oversell`.
`--baseline` sends the same requests to `/api/noop`. See docs/load-runs.md#locust-alone.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import time
import urllib.parse
import urllib.request
import uuid

import gevent
from gevent.resolver.blocking import Resolver as BlockingResolver
from locust import FastHttpUser, LoadTestShape, constant, events, task
from locust.runners import WORKER_REPORT_INTERVAL, MasterRunner, WorkerRunner

logger = logging.getLogger("flashsale.locust")

#: Exit code of a run whose audit found oversell.
OVERSOLD_EXIT_CODE = 3
#: The 409s a flash sale answers correctly: successes, not failures.
CORRECT_CONFLICTS = {"sold_out", "limit_reached", "not_started"}
#: Stats name of the checkouts answered `409 sold_out`.
SOLD_OUT_NAME = "checkout sold out"
#: With --until-sold-out, the run ends once no unit has sold for this long after a sold_out.
SOLD_OUT_QUIET_SECONDS = 1.0
#: The crowd is spawned this long before the opening (a shape ticks once a second), so that it
#: is all there when the sale opens.
CROWD_LEAD_SECONDS = 1.0
_LOCK_TIMING = re.compile(r"lock;dur=([0-9.]+)")


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    group = parser.add_argument_group("flashsale")
    group.add_argument("--sku", default="", help="the item on sale (required)")
    group.add_argument("--strategy", default="", help="its strategy, for the record")
    group.add_argument("--qty", type=int, default=1, help="units per checkout")
    group.add_argument(
        "--baseline", action="store_true", help="hit /api/noop instead: the HTTP ceiling"
    )
    group.add_argument(
        "--allow-oversell",
        action="store_true",
        help="do not fail the run when the audit finds oversell (the unsafe baseline)",
    )
    group.add_argument(
        "--warmup-share",
        type=float,
        default=0.1,
        help="share of the run with a tenth of the users, before the crowd arrives "
        "(unless --opens-at says when)",
    )
    group.add_argument(
        "--opens-at",
        type=float,
        default=0.0,
        help="Unix time the sale opens: the crowd buys from then on, a tenth of it looks before",
    )
    group.add_argument(
        "--until-sold-out",
        action="store_true",
        help="end the run once buyers are told sold out and nothing more sells (-t still caps)",
    )


@events.init.add_listener
def _resolve_addresses_in_place(environment, **_kwargs) -> None:
    """Against a host given as an IP address, look it up in place, not on gevent's threads.

    The shop's sync workers close each connection after its answer, so a buyer connects anew
    for every request, and the client looks the host up each time. gevent's default resolver
    hands every lookup to a thread and waits for it: 150 us of CPU for an address that needs
    no lookup, about a fifth of what a request costs the crowd, on the host that serves the
    sale. Looked up in place, an address costs 11 us and never blocks (a name still goes to
    the threads: a DNS lookup in place would stall every buyer of the process).
    """
    if _is_ip_address(urllib.parse.urlsplit(environment.host or "").hostname):
        hub = gevent.get_hub()
        hub.resolver = BlockingResolver(hub)


def _is_ip_address(host: str | None) -> bool:
    try:
        ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return True


#: When the crowd buys (monotonic clock of this process); until then buyers only look.
_crowd_at = 0.0


def _seconds_to_opening(options, elapsed: float) -> float:
    """Seconds from now until the crowd buys (negative once it does); elapsed: of this run."""
    if options.opens_at:
        return options.opens_at - time.time()
    return (options.run_time or 0) * options.warmup_share - elapsed


@events.test_start.add_listener
def _check_options(environment, **_kwargs) -> None:
    global _crowd_at
    options = environment.parsed_options
    if options is not None and not options.sku:
        raise SystemExit("flashsale locustfile: --sku is required")
    if options is not None:
        _crowd_at = time.monotonic() + max(_seconds_to_opening(options, 0.0), 0.0)


class Buyer(FastHttpUser):
    """One buyer in the crowd."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.buyer = f"buyer-{uuid.uuid4().hex[:12]}"
        options = self.environment.parsed_options
        self.sku = options.sku
        self.qty = options.qty
        self.baseline = options.baseline

    @task(1)
    def view_item(self) -> None:
        if self.baseline:
            self.client.get("/api/noop", name="item")
            return
        with self.client.get(f"/api/items/{self.sku}", name="item", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"item answered {r.status_code}")

    @task(4)
    def checkout(self) -> None:
        if time.monotonic() < _crowd_at:
            # Early visitors watch the item (and its countdown); the crowd buys.
            self.view_item()
            return
        body = {"sku": self.sku, "qty": self.qty, "buyer": self.buyer}
        path = "/api/noop" if self.baseline else "/api/checkout"
        with self.client.post(path, json=body, name="checkout", catch_response=True) as r:
            if self.baseline:
                return
            self._judge(r)

    def _judge(self, response) -> None:
        status = response.status_code
        error = _error_code(response) if status == 409 else None
        if status == 201:
            for _ in range(self.qty):
                self._record("UNITS", "sold", 0)
        elif error in CORRECT_CONFLICTS:
            if error == "sold_out":
                response.request_meta["name"] = SOLD_OUT_NAME
            response.success()
        else:
            response.failure(f"{status} {_error_code(response) or ''}".strip())
            return
        timing = _LOCK_TIMING.search(response.headers.get("Server-Timing") or "")
        if timing:
            self._record("LOCK", "wait", float(timing.group(1)))

    def _record(self, kind: str, name: str, milliseconds: float) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=milliseconds,
            response_length=0,
            exception=None,
            context={},
        )


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content or b"{}").get("error")
    except ValueError:
        return None


class FlashCrowd(LoadTestShape):
    """A trickle of early visitors, then the whole crowd at once, held until the run time ends
    (or, with --until-sold-out, until the sale is over).

    Uses -u (users), -r (spawn rate) and -t (run time) from the command line.
    """

    def __init__(self) -> None:
        super().__init__()
        self._units_seen = 0
        self._units_changed_at = time.monotonic()

    def tick(self):
        options = self.runner.environment.parsed_options
        run_time = options.run_time or 60
        elapsed = self.get_run_time()
        if elapsed >= run_time:
            return None
        if options.until_sold_out and self._sale_over():
            logger.info("sold out, and nothing sells any more: ending the run")
            return None
        users = options.num_users or 1
        if _seconds_to_opening(options, elapsed) > CROWD_LEAD_SECONDS:
            return max(1, users // 10), options.spawn_rate
        return users, options.spawn_rate

    def _sale_over(self) -> bool:
        """Buyers were told sold out, and no unit has sold since for a quiet spell: the
        SOLD_OUT_QUIET_SECONDS, or on a master longer than the workers take to report, since
        its stats are their last reports."""
        runner = self.runner
        assert runner is not None, "a shape runs inside a Locust runner"
        entries = runner.stats.entries
        sold = entries.get(("sold", "UNITS"))
        units = sold.num_requests if sold is not None else 0
        now = time.monotonic()
        if units != self._units_seen:
            self._units_seen, self._units_changed_at = units, now
        refused = entries.get((SOLD_OUT_NAME, "POST"))
        told_sold_out = refused is not None and refused.num_requests > 0
        quiet = SOLD_OUT_QUIET_SECONDS
        if isinstance(self.runner, MasterRunner):
            quiet += WORKER_REPORT_INTERVAL
        return told_sold_out and now - self._units_changed_at >= quiet


@events.test_stop.add_listener
def _audit(environment, **_kwargs) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    options = environment.parsed_options
    if options is None or options.baseline or not options.sku:
        return
    url = f"{environment.host.rstrip('/')}/api/items/{options.sku}/audit"
    request = urllib.request.Request(url)
    if os.environ.get("FLASHSALE_API_TOKEN"):  # the shop's: the audit is not public
        request.add_header("Authorization", f"Bearer {os.environ['FLASHSALE_API_TOKEN']}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            audit = json.loads(response.read())
    except (OSError, ValueError) as exc:  # an audit that cannot run must fail the run
        logger.error("audit of %s failed: %s", options.sku, exc)
        environment.process_exit_code = 1
        return
    logger.info("audit %s", json.dumps(audit))
    if audit.get("oversold"):
        verdict = "expected for this baseline" if options.allow_oversell else "FAILED"
        logger.error(
            "%s (%s) oversold %s units: %s",
            options.sku,
            audit.get("strategy"),
            audit["oversold"],
            verdict,
        )
        if not options.allow_oversell:
            environment.process_exit_code = OVERSOLD_EXIT_CODE
