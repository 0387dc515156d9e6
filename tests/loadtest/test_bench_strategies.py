"""The benchmark without HTTP: one run drives every strategy, the peer locks and the ceilings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from inventory.exceptions import Busy
from loadtest.bench.buyers import buy_until_done
from loadtest.bench.contenders import HOT_ROW, PEERS, REDIS_PY_DEFAULT, BuyerReport, Result
from loadtest.bench.report import median_row, print_ratios, ratios
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)

STOCK = 30
SAFE = [
    "lock",
    "segmented",
    "lua",
    "optimistic",
    "lua, group commit",
    "lua, sale writer",
    "segmented, sale writer",
    "lock +5 ms work",
    "segmented +5 ms work",
    *(peer.label for peer in PEERS.values()),
    "take + row sale (SQL)",
    "hot row (SQL)",
]
ROW = re.compile(
    r"^(?P<contender>\S.*?)\s{2,}(?P<rate>\d+)\s+(?P<sold>\d+)\s+(?P<busy>\d+)\s+"
    r"(?P<oversold>\d+)\s+(?P<remaining>\S+)\s+(?P<consistent>yes|NO)\s"
)


def test_a_tiny_run_prints_every_contender_and_no_safe_one_oversells(django_db_setup, tmp_path):
    # Given tiny settings, against the test database and this session's Redis prefix
    report = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "loadtest.bench_strategies",
        "--buyers", "2", "--stock", str(STOCK), "--duration", "5", "--ceiling-stock", "300",
        "--json", str(report),
    ]  # fmt: skip

    # When the benchmark runs every contender in turn
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=180
    )

    # Then it exits 0 and prints one row per contender, the six targets (one of them on p99
    # time per sale) and the two bounds
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {
        match["contender"]: match
        for match in map(ROW.match, result.stdout.splitlines())
        if match is not None
    }
    expected = [*SAFE, "unsafe", "raw EVALSHA"]
    assert sorted(rows) == sorted(expected), result.stdout
    for name in SAFE:
        assert rows[name]["oversold"] == "0", rows[name].string
        assert rows[name]["consistent"] == "yes", rows[name].string
    assert result.stdout.count("(target >= ") == 5, result.stdout
    assert result.stdout.count("(target <= ") == 1, result.stdout
    # with the tail of both sides of the p99 target beside it
    assert re.search(
        r"its tail, ms: lock p99\.9 \d+\.\d, longest \d+\.\d; "
        r"redis-py Lock sleep=0\.1 p99\.9 \d+\.\d, longest \d+\.\d",
        result.stdout,
    ), result.stdout
    # and what that p99 target asks of a lock that serves its buyers in turn
    assert re.search(
        r"a sale takes buyers / buys/s on average: lock \d+\.\d ms, redis-py Lock sleep=0\.1 "
        r"\d+\.\d; .* a p99 of \d+\.\d\d ms needs [\d,]+ buys/s, \d+\.\d\dx the hot row",
        result.stdout,
    ), result.stdout
    assert re.search(r"lua, sale writer\s+vs hot row \(SQL\)\s+\d+\.\d\dx", result.stdout)
    assert re.search(r"lua\s+vs hot row \(SQL\)\s+\d+\.\d\dx", result.stdout), result.stdout
    assert re.search(r"segmented, sale writer\s+vs lock\s+\d+\.\d\dx", result.stdout)
    # the sale writer's row says how it batched, and segmented's how many of its holders' locks
    # the writer released
    assert re.search(r"sale writer: \d+ sales in \d+ batches", result.stdout), result.stdout
    assert re.search(r"holders' locks released with their commits: [1-9]", result.stdout)
    # and how long the writer and its backend ran and queued for a CPU, per batch
    assert re.search(
        r"on a CPU / waiting for one: writer \d+\.\d\d / \d+\.\d\d, "
        r"its backends \d+\.\d\d / \d+\.\d\d",
        result.stdout,
    ), result.stdout
    # and how many statements it had in flight at once, on how many connections
    assert re.search(r"in flight at once, at most: 1 of 1 connections", result.stdout)
    assert re.search(r"lock\s+vs hot row \(SQL\)\s+\d+\.\d\dx", result.stdout), result.stdout
    assert re.search(r"take \+ row sale \(SQL\)\s+vs hot row \(SQL\)\s+\d", result.stdout)
    # and every unit a buyer was sold is an order in the database
    results = {entry["contender"]: entry for entry in json.loads(report.read_text())["results"]}
    for name in SAFE:
        assert results[name]["errors"] == [], results[name]["errors"]
        assert results[name]["sold"] == results[name]["accepted_units"] <= STOCK, results[name]
        # and how evenly the buyers shared the sales: the fewest any one sold, over an even share
        assert 0.0 <= results[name]["fewest_share"] <= 1.0, results[name]
        # and what PostgreSQL wrote to its log per unit: at least each unit's order row
        assert results[name]["wal_bytes_per_buy"] > 100, results[name]
    assert json.loads(report.read_text())["broken"] == []
    # and the writer's own count is the round's: every `lua` sale of the round went through
    # it, and none of the warm-up's did (a `segmented` holder whose batch was refused writes
    # its own sale, so there it may be fewer)
    written = {
        name: [
            int(count)
            for note in results[name]["notes"]
            for count in re.findall(r"sale writer: (\d+) sales", note)
        ]
        for name in ("lua, sale writer", "segmented, sale writer")
    }
    assert written["lua, sale writer"] == [results["lua, sale writer"]["sold"]], written
    (segmented_written,) = written["segmented, sale writer"]
    assert 0 < segmented_written <= results["segmented, sale writer"]["sold"], written
    # (the buyers warmed up first, on sales of their own: the measured sales' orders above are
    # exactly the units they counted after the barrier)
    assert json.loads(report.read_text())["parameters"]["warmup"] == 25


@pytest.mark.parametrize("peer", list(PEERS))
def test_a_peer_row_builds_the_peers_lock_through_the_strategies_seam(settings, peer):
    from django.utils.module_loading import import_string

    from inventory.strategies import plumbing
    from loadtest import peer_locks

    expected = {
        "redis-py": peer_locks.RedisPyLock,
        "redis-py-5ms": peer_locks.RedisPyLock,
        "python-redis-lock": peer_locks.PythonRedisLock,
        "python-redis-lock-renewal": peer_locks.PythonRedisLock,
    }[peer]
    assert import_string(PEERS[peer].factory)  # the path resolves
    settings.FLASHSALE_LOCK_FACTORY = PEERS[peer].factory
    lock = plumbing.new_lock("bench-seam-test", strategy="lock")
    assert type(lock) is expected and lock.name == "bench-seam-test"
    settings.FLASHSALE_LOCK_FACTORY = "locking.Lock"
    assert type(plumbing.new_lock("bench-seam-test", strategy="lock")).__module__ == "locking.lock"


def test_the_lock_strategy_runs_a_peers_lock_when_the_seam_names_it(settings):
    # python-redis-lock keeps its lock under `lock:<name>`; ours under the name itself
    import threading

    from inventory import keys
    from inventory.models import Item
    from inventory.redis_client import get_redis_client
    from inventory.services import place_order, start_sale

    settings.FLASHSALE_LOCK_FACTORY = PEERS["python-redis-lock"].factory
    settings.FLASHSALE_HOLD_DELAY_MS = 400  # work inside the critical section: time to look
    start_sale(sku="seam", stock=2, strategy="lock")
    name = keys.item_lock(Item.objects.get(sku="seam"))
    client = get_redis_client()
    seen = []

    def look() -> None:
        for _ in range(60):
            seen.append((client.exists(f"lock:{name}"), client.exists(name)))
            threading.Event().wait(0.01)

    watcher = threading.Thread(target=look)
    watcher.start()
    place_order(sku="seam", qty=1, buyer="ann")
    watcher.join()
    assert (1, 0) in seen  # held, the peer's way
    assert (0, 1) not in seen  # never ours
    assert Item.objects.get(sku="seam").units_left == 1


def test_scheduled_seconds_count_a_processs_time_on_a_cpu_and_in_the_queue():
    from loadtest.bench.measure import scheduled_seconds

    # Given this process's reading (its main thread's, as /proc/<pid>/schedstat gives it),
    # then a busy spell of 0.2 s of that thread's CPU (not the process's: a thread an earlier
    # test left running would count there)
    before = scheduled_seconds(os.getpid())
    assert before is not None
    spent = time.thread_time() + 0.2
    while time.thread_time() < spent:
        pass
    after = scheduled_seconds(os.getpid())
    # Then its time on a CPU grew by at least that, and its queueing never went back
    assert after is not None
    assert after[0] - before[0] >= 0.19
    assert after[1] >= before[1]
    # and a process that is not there has no reading
    assert scheduled_seconds(2**22 + 1) is None


def test_a_sales_time_runs_from_the_first_call_for_its_unit_busy_answers_included():
    # Given a buyer told busy twice (each after 20 ms) before its first unit, then sold one
    # more at once, then told sold out
    answers = iter(["busy", "busy", "sold", "sold", "sold out"])

    def buy() -> bool:
        answer = next(answers)
        if answer == "busy":
            time.sleep(0.02)
            raise Busy("the lock stayed taken")
        return answer == "sold"

    # When it buys until done
    report = BuyerReport()
    buy_until_done(buy, report, duration=60)

    # Then both sales and both busy answers are counted, and the first sale's time holds the
    # waits of the busy answers before it
    assert report.sold == 2 and report.busy == 2 and not report.capped
    assert len(report.sale_seconds) == 2
    assert report.sale_seconds[0] >= 0.04


def _result(name: str, rate: float, p99: float, round_: int = 1) -> Result:
    """A round of 8 buyers selling 5,000 units at `rate` buys/s."""
    return Result(
        contender=name, kind="strategy", round=round_, buyers=8, stock=5000, sold=5000, busy=0,
        seconds=5000 / rate, buys_per_second=rate, capped=False, errors=[],
        accepted_units=5000, oversold=0, remaining=0, consistent=True, safe=True,
        client_cpu_ms_per_buy=None, postgres_cpu_ms_per_buy=None,
        redis_cpu_ms_per_buy=None, host_cpu_busy=None, p99_ms=p99,
    )  # fmt: skip


def test_a_p99_target_asks_a_lock_that_serves_in_turn_for_buyers_over_that_p99():
    # Given a round of 8 buyers: `lock` sold 1,000 buys/s, a peer had a p99 of 4 ms, and the
    # hot row sold 2,000 buys/s
    result = _result
    rows = {
        "lock": result("lock", 1000, 12.0),
        REDIS_PY_DEFAULT: result(REDIS_PY_DEFAULT, 1250, 4.0),
        HOT_ROW: result(HOT_ROW, 2000, 15.0),
    }

    # When the p99 target (0.2x the peer's) is checked
    (check,) = [c for c in ratios(rows) if c["measure"] == "p99"]

    # Then a sale took buyers / buys/s on average (8 ms, 6.4 ms), and a p99 of 0.8 ms asks
    # 8 / 0.8 ms = 10,000 buys/s, five times the hot row
    share = check["even_share"]
    assert share["mean_ms"] == pytest.approx(8.0)
    assert share["versus_mean_ms"] == pytest.approx(6.4)
    assert share["p99_ms"] == pytest.approx(0.8)
    assert share["needed"] == pytest.approx(10_000)
    assert share["ceiling"] == (HOT_ROW, pytest.approx(5.0))


def test_each_target_gives_its_ratio_round_by_round_beside_the_medians(capsys):
    # Given three rounds in which the hot row moved more than the writer: 1.33x, 2.27x and
    # 1.31x round by round, while the medians (3,308 and 1,646) give 2.01x
    writer = [3308, 3392, 2154]
    hot_row = [2486, 1492, 1646]
    rounds = {
        "lua, sale writer": [_result("lua, sale writer", r, 5.0, i) for i, r in enumerate(writer)],
        HOT_ROW: [_result(HOT_ROW, r, 15.0, i) for i, r in enumerate(hot_row)],
    }
    medians = {name: median_row(results) for name, results in rounds.items()}

    # When the targets are worked out and printed
    checks = ratios(medians, 0, rounds)
    print_ratios(checks)

    # Then the verdict is the medians' ratio, and every round's ratio is given beside it
    (check,) = [c for c in checks if c["what"] == "lua, sale writer" and c["versus"] == HOT_ROW]
    assert check["ratio"] == pytest.approx(3308 / 1646)
    assert check["met"] is True
    assert check["round_ratios"] == pytest.approx([3308 / 2486, 3392 / 1492, 2154 / 1646])
    assert "2.01x  (target >= 2.00x): met; rounds: 1.33x, 2.27x, 1.31x" in capsys.readouterr().out
    # and a ratio with nothing measured, or a single round, has none
    assert all("round_ratios" not in c for c in checks if c is not check)
    single = {name: results[:1] for name, results in rounds.items()}
    assert all("round_ratios" not in c for c in ratios(medians, 0, single))


def test_a_p99_target_over_rounds_holds_the_median_p99s_against_each_other(capsys):
    # Given three rounds in which the peer's round of median rate kept its sleepers out of its
    # p99 (4.1 ms), and its other two did not
    lock = [_result("lock", rate, p99, i) for i, (rate, p99) in enumerate(
        [(700, 16.0), (750, 19.8), (580, 25.0)])]  # fmt: skip
    peer = [_result(REDIS_PY_DEFAULT, rate, p99, i) for i, (rate, p99) in enumerate(
        [(1445, 4.1), (1478, 104.0), (1114, 78.0)])]  # fmt: skip
    rounds = {"lock": lock, REDIS_PY_DEFAULT: peer, HOT_ROW: [_result(HOT_ROW, 2200, 15.0)] * 3}
    medians = {name: median_row(results) for name, results in rounds.items()}
    assert medians[REDIS_PY_DEFAULT].p99_ms == 4.1  # the round of the median rate

    # When the p99 target is checked
    checks = ratios(medians, 0, rounds)
    print_ratios(checks)

    # Then it holds the median of lock's p99s (19.8) against the median of the peer's (78.0),
    # beside every round's own ratio
    (check,) = [c for c in checks if c["measure"] == "p99"]
    assert check["ratio"] == pytest.approx(19.8 / 78.0)
    assert check["met"] is False
    assert check["p99_medians"] == {"lock": 19.8, REDIS_PY_DEFAULT: 78.0}
    assert check["round_ratios"] == pytest.approx([16.0 / 4.1, 19.8 / 104.0, 25.0 / 78.0])
    assert check["even_share"]["p99_ms"] == pytest.approx(78.0 * 0.2)
    out = capsys.readouterr().out
    assert "0.25x  (target <= 0.20x): MISSED; rounds: 3.90x, 0.19x, 0.32x" in out
    assert f"the medians of the rounds' p99s, ms: lock 19.8, {REDIS_PY_DEFAULT} 78.0" in out
