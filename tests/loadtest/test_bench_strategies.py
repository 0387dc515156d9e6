"""The benchmark without HTTP: one run drives every strategy, the peer locks and the ceilings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from inventory.exceptions import Busy
from loadtest.bench.buyers import buy_until_done
from loadtest.bench.contenders import (
    EVALSHA_SELL,
    HOT_ROW,
    LUA_BATCHED,
    PEERS,
    REDIS_PY_DEFAULT,
    SEGMENTED_BATCHED,
    BuyerReport,
    Result,
    contenders_for,
)
from loadtest.bench.report import crowd_ratios, median_row, print_crowds, print_ratios, ratios
from loadtest.bench.strategies import parse_args
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)

STOCK = 30
ROUNDS = 2
BATCHED = [LUA_BATCHED, SEGMENTED_BATCHED]
SAFE = [
    "lock",
    "segmented",
    "lua",
    "optimistic",
    *BATCHED,
    "lock +5 ms work",
    "segmented +5 ms work",
    *(peer.label for peer in PEERS.values()),
    "take + row sale (SQL)",
    "hot row (SQL)",
]
CROWD_OF_TWO = ["lua, batched, 2 buyers", "hot row (SQL), 2 buyers"]
ROW = re.compile(
    r"^(?P<contender>\S.*?)\s{2,}(?P<rate>\d+)\s+(?P<sold>\d+)\s+(?P<busy>\d+)\s+"
    r"(?P<oversold>\d+)\s+(?P<remaining>\S+)\s+(?P<consistent>yes|NO)\s"
)


def _rate_target(what: str, versus: str, target: str) -> str:
    """The printed line of a rate target, met or missed, as a pattern."""
    return (
        rf"{re.escape(what)}\s+vs {re.escape(versus)}\s+\d+\.\d\dx  "
        rf"\(target >= {re.escape(target)}x\): (met|MISSED)"
    )


@pytest.mark.slow
def test_a_tiny_run_prints_every_contender_and_no_safe_one_oversells(django_db_setup, tmp_path):
    # Given tiny settings, against the test database and this session's Redis prefix: four
    # buyers, which the batched rows run as the four threads of one process
    report = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "loadtest.bench_strategies",
        "--buyers", "4", "--batch-threads", "4", "--stock", str(STOCK), "--duration", "5",
        "--warmup", "5", "--work-buyers", "3", "--ceiling-stock", "300",
        "--rounds", str(ROUNDS), "--crowds", "2", "--json", str(report),
    ]  # fmt: skip

    # When the benchmark runs every contender in turn, twice, and lua batched and the hot row
    # again with a crowd of two
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=600
    )

    # Then it exits 0 and prints one row per contender, none of the safe ones oversold
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {
        match["contender"]: match
        for match in map(ROW.match, result.stdout.splitlines())
        if match is not None
    }
    expected = [*SAFE, *CROWD_OF_TWO, "unsafe", "raw EVALSHA"]
    assert sorted(rows) == sorted(expected), result.stdout
    for name in [*SAFE, *CROWD_OF_TWO]:
        assert rows[name]["oversold"] == "0", rows[name].string
        assert rows[name]["consistent"] == "yes", rows[name].string
    # and the targets, each met or missed: four on rates, the one under work, and lock's
    # fewest share with redis-py's default beside it; the p99 target against redis-py is gone
    targets = [
        _rate_target("lua, batched", "hot row (SQL)", "2.00"),
        _rate_target("lock", "hot row (SQL)", "0.35"),
        _rate_target("segmented", "lock", "1.50"),
        _rate_target("segmented +5 ms work", "lock +5 ms work", "5.00"),
        _rate_target("lock", "python-redis-lock", "1.00"),
        r"lock fewest\s+\d\.\d\d   \(target >= 0\.80\): (met|MISSED); "
        r"redis-py Lock sleep=0\.1 fewest \d\.\d\d",
    ]
    for target in targets:
        assert re.search(rf"^  {target}; rounds: ", result.stdout, re.MULTILINE), target
    assert result.stdout.count("(target >= ") == len(targets), result.stdout
    assert "(target <= " not in result.stdout and "lock p99" not in result.stdout
    # and the bounds, the batched rows against their strategy a process per buyer
    assert re.search(r"lua, batched\s+vs lua\s+\d+\.\d\dx", result.stdout), result.stdout
    assert re.search(r"segmented, batched\s+vs segmented\s+\d+\.\d\dx", result.stdout)
    assert re.search(r"lua\s+vs hot row \(SQL\)\s+\d+\.\d\dx", result.stdout), result.stdout
    assert re.search(r"take \+ row sale \(SQL\)\s+vs hot row \(SQL\)\s+\d", result.stdout)
    # and every unit a buyer was sold is an order in the database
    saved = json.loads(report.read_text())
    results: dict[str, list[dict]] = {}
    for entry in saved["results"]:
        results.setdefault(entry["contender"], []).append(entry)
    for name in [*SAFE, *CROWD_OF_TWO]:
        assert len(results[name]) == ROUNDS
        for run in results[name]:
            assert run["errors"] == [], run["errors"]
            assert run["sold"] == run["accepted_units"] <= STOCK, run
            assert run["oversold"] == 0 and run["consistent"], run
            # and how evenly the buyers shared the sales: the fewest any one sold, over an
            # even share (a thread of the batched rows is a buyer)
            assert 0.0 <= run["fewest_share"] <= 1.0, run
            # and what PostgreSQL wrote to its log per unit: at least each unit's order row
            assert run["wal_bytes_per_buy"] > 100, run
    assert saved["broken"] == [] and saved["crashed"] == []
    # and the batched rows' threads shared commits: more than one unit per commit, at least
    # once over the rounds, said under the row; the others report none
    for name in BATCHED:
        assert all(run["buyers"] == 4 for run in results[name])
        per_commit = [run["units_per_commit"] for run in results[name]]
        assert all(figure is not None and figure >= 1.0 for figure in per_commit), per_commit
        assert max(per_commit) > 1.0, (name, per_commit)
        for run in results[name]:
            assert run["notes"] == [f"units per commit {run['units_per_commit']:.1f}"], run
    assert re.search(
        r"^lua, batched .*\n    units per commit \d+\.\d$", result.stdout, re.MULTILINE
    ), result.stdout
    assert all(run["units_per_commit"] is None for run in results["lua"])
    assert saved["parameters"]["warmup"] == 5 and saved["parameters"]["batch_threads"] == 4
    # and the rows of the crowd of two ran two buyers, the batched one as threads of one
    # process that shared commits at least once; the table gives both crowds
    assert all(run["buyers"] == 2 for name in CROWD_OF_TWO for run in results[name])
    assert max(run["units_per_commit"] for run in results[CROWD_OF_TWO[0]]) > 1.0
    assert [line["buyers"] for line in saved["crowds"]] == [2, 4]
    assert all(line["ratio"] > 0 and line["versus_best"] > 0 for line in saved["crowds"])
    assert re.search(r"^crowds \(buys/s; lua, batched: 1 processes", result.stdout, re.MULTILINE)


@pytest.mark.parametrize("peer", list(PEERS))
def test_a_peer_row_builds_the_peers_lock_through_the_strategies_seam(settings, peer):
    from django.utils.module_loading import import_string

    from inventory.strategies import locks
    from loadtest import peer_locks

    expected = {
        "redis-py": peer_locks.RedisPyLock,
        "redis-py-5ms": peer_locks.RedisPyLock,
        "python-redis-lock": peer_locks.PythonRedisLock,
        "python-redis-lock-renewal": peer_locks.PythonRedisLock,
    }[peer]
    assert import_string(PEERS[peer].factory)  # the path resolves
    settings.FLASHSALE_LOCK_FACTORY = PEERS[peer].factory
    lock = locks.new_lock("bench-seam-test", strategy="lock", peers=True)
    assert type(lock) is expected and lock.name == "bench-seam-test"
    settings.FLASHSALE_LOCK_FACTORY = "locking.Lock"
    assert (
        type(locks.new_lock("bench-seam-test", strategy="lock", peers=True)).__module__
        == "locking.lock"
    )


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


def _result(name: str, rate: float, round_: int = 1, fewest: float | None = None) -> Result:
    """A round of 8 buyers selling 5,000 units at `rate` buys/s."""
    return Result(
        contender=name, kind="strategy", round=round_, buyers=8, stock=5000, sold=5000, busy=0,
        seconds=5000 / rate, buys_per_second=rate, capped=False, errors=[],
        accepted_units=5000, oversold=0, remaining=0, consistent=True, safe=True,
        client_cpu_ms_per_buy=None, postgres_cpu_ms_per_buy=None,
        redis_cpu_ms_per_buy=None, host_cpu_busy=None, fewest_share=fewest,
    )  # fmt: skip


def test_each_target_gives_its_ratio_round_by_round_beside_the_medians(capsys):
    # Given three rounds in which the hot row moved more than lua, batched: 1.33x, 2.27x and
    # 1.31x round by round, while the medians (3,308 and 1,646) give 2.01x
    batched = [3308, 3392, 2154]
    hot_row = [2486, 1492, 1646]
    rounds = {
        LUA_BATCHED: [_result(LUA_BATCHED, r, i) for i, r in enumerate(batched)],
        HOT_ROW: [_result(HOT_ROW, r, i) for i, r in enumerate(hot_row)],
    }
    medians = {name: median_row(results) for name, results in rounds.items()}

    # When the targets are worked out and printed
    checks = ratios(medians, 0, rounds)
    print_ratios(checks)

    # Then the verdict is the medians' ratio, and every round's ratio is given beside it
    (check,) = [c for c in checks if c["what"] == LUA_BATCHED and c["versus"] == HOT_ROW]
    assert check["ratio"] == pytest.approx(3308 / 1646)
    assert check["met"] is True
    assert check["round_ratios"] == pytest.approx([3308 / 2486, 3392 / 1492, 2154 / 1646])
    assert "2.01x  (target >= 2.00x): met; rounds: 1.33x, 2.27x, 1.31x" in capsys.readouterr().out
    # and a ratio with nothing measured, or a single round, has none
    assert all("round_ratios" not in c for c in checks if c is not check)
    single = {name: results[:1] for name, results in rounds.items()}
    assert all("round_ratios" not in c for c in ratios(medians, 0, single))


def test_the_fairness_target_holds_locks_median_fewest_share_with_redis_pys_beside_it(capsys):
    # Given three rounds in which lock's buyers shared alike and redis-py's default left one
    # buyer nearly without a unit; lock's round of median rate is its least even one
    lock = [_result("lock", rate, i, fewest) for i, (rate, fewest) in enumerate(
        [(700, 0.75), (750, 0.95), (580, 0.90)])]  # fmt: skip
    peer = [_result(REDIS_PY_DEFAULT, rate, i, fewest) for i, (rate, fewest) in enumerate(
        [(1445, 0.18), (1478, 0.02), (1114, 0.40)])]  # fmt: skip
    rounds = {"lock": lock, REDIS_PY_DEFAULT: peer}
    medians = {name: median_row(results) for name, results in rounds.items()}
    assert medians["lock"].fewest_share == 0.75  # the round of the median rate

    # When the targets are worked out and printed
    checks = ratios(medians, 0, rounds)
    print_ratios(checks)

    # Then the fairness target holds the median of lock's rounds (0.90) against 0.8: met,
    # with the median of redis-py's (0.18) beside it and every round's share
    (check,) = [c for c in checks if c["measure"] == "fewest"]
    assert (check["what"], check["versus"], check["target"]) == ("lock", REDIS_PY_DEFAULT, 0.8)
    assert check["ratio"] == pytest.approx(0.90)
    assert check["met"] is True
    assert check["beside"] == pytest.approx(0.18)
    assert check["round_ratios"] == [0.75, 0.95, 0.90]
    out = capsys.readouterr().out
    assert (
        "lock fewest                0.90   (target >= 0.80): met; "
        "redis-py Lock sleep=0.1 fewest 0.18; rounds: 0.75, 0.95, 0.90" in out
    )
    # and one round below it misses it
    (single,) = [c for c in ratios({"lock": lock[0]}) if c["measure"] == "fewest"]
    assert single["ratio"] == 0.75 and single["met"] is False and single["beside"] is None


def test_crowds_repeat_lua_batched_and_the_hot_row_with_as_many_processes_as_the_default():
    # Given the default crowd (8 buyers as 2 processes of 4 threads) and crowds of 5 and 16,
    # the default's crowd named again
    args = parse_args(["--strategies", "lua", "--crowds", "16", "5", "8", "--work-ms", "0"])
    args.peers = []
    assert args.crowds == [5, 16]

    # When the run's contenders are made
    contenders = {contender.name: contender for contender in contenders_for(args)}

    # Then each crowd has the batched row as 2 processes (16: 8 threads each; 5: 3 and 2) and
    # the hot row a process a buyer, each buying its row's way on a sale of its own
    batched, hot_row = contenders["lua, batched, 16 buyers"], contenders["hot row (SQL), 16 buyers"]
    assert (batched.buyers, batched.threads, batched.strategy) == (16, 8, "lua")
    assert (batched.way, hot_row.way) == (LUA_BATCHED, HOT_ROW)
    assert (hot_row.buyers, hot_row.threads, hot_row.kind) == (16, 1, "ceiling")
    assert contenders["lua, batched, 5 buyers"].threads == 3
    assert len({contender.sku for contender in contenders.values()}) == len(contenders)
    assert contenders[EVALSHA_SELL].way == EVALSHA_SELL
    # and without lua among the strategies, only the hot row repeats
    args = parse_args(["--strategies", "lock", "--crowds", "16", "--work-ms", "0"])
    args.peers = []
    names = [contender.name for contender in contenders_for(args)]
    assert "hot row (SQL), 16 buyers" in names and "lua, batched, 16 buyers" not in names


def test_the_crowd_table_holds_lua_batched_against_the_hot_row_at_each_crowd_and_its_best(capsys):
    # Given a hot row that sells most with 4 buyers and lua, batched most with 16
    rows = {
        row.contender: row
        for row in [
            _result("lua, batched, 4 buyers", 2800),
            _result("hot row (SQL), 4 buyers", 3000),
            _result(LUA_BATCHED, 4200),
            _result(HOT_ROW, 2400),
            _result("lua, batched, 16 buyers", 5800),
            _result("hot row (SQL), 16 buyers", 2000),
        ]
    }

    # When the table is worked out (8 buyers the run's default) and printed
    table = crowd_ratios(rows, 8, [4, 16])
    print_crowds(table, 2)

    # Then each crowd's ratio is at its own crowd, and each is also held against the hot
    # row at 4 buyers, its best
    assert [line["buyers"] for line in table] == [4, 8, 16]
    assert [line["ratio"] for line in table] == pytest.approx([2800 / 3000, 1.75, 2.9])
    assert [line["versus_best"] for line in table] == pytest.approx([2800 / 3000, 1.4, 5800 / 3000])
    assert {line["best_hot_row_buyers"] for line in table} == {4}
    out = capsys.readouterr().out
    assert "best: the hot row at 4 buyers" in out
    assert "      16          5800     2000   2.90x    1.93x" in out
    # and a crowd whose rows are missing prints dashes; no --crowds, no table
    table = crowd_ratios({HOT_ROW: rows[HOT_ROW]}, 8, [16])
    assert table[1] == {"buyers": 16, "batched": None, "hot_row": None, "ratio": None,
                        "best_hot_row_buyers": 8, "versus_best": None}  # fmt: skip
    assert crowd_ratios(rows, 8, []) == []
