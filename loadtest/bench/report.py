"""The printed results: medians, the table, where the time goes, the targets and bounds."""

from __future__ import annotations

import statistics
from typing import Any

from .contenders import (
    BOUNDS,
    HOT_ROW,
    LUA_BATCHED,
    TARGETS,
    WORK_TARGET,
    Result,
    at_crowd,
    with_work,
)
from .measure import PROFILE_PHASES


def median_row(results: list[Result]) -> Result:
    """The round with the median rate (the lower one of the two middle rounds)."""
    ranked = sorted(results, key=lambda result: result.buys_per_second)
    return ranked[(len(ranked) - 1) // 2]


def ratios(
    rows: dict[str, Result], work_ms: int = 0, rounds: dict[str, list[Result]] | None = None
) -> list[dict[str, Any]]:
    """The targets (with `segmented` vs `lock` also under --work-ms), then the bounds, each
    from the median rows; with `rounds` (every contender's results, round by round), each also
    gives its figure in every round (`round_ratios`), so that a median's spread shows.

    A "fewest" target holds the median of `what`'s rounds' fewest shares (the round of the
    median rate need not be that of the median share), `versus`'s beside it (`beside`)."""
    pairs: list[tuple[str, str, float | None, str]] = list(TARGETS)
    if work_ms:
        pairs.insert(
            3, (with_work("segmented", work_ms), with_work("lock", work_ms), WORK_TARGET, "rate")
        )
    pairs += [(name, versus, None, "rate") for name, versus in BOUNDS]

    def every_round(name: str) -> list[Result]:
        if rounds and rounds.get(name):
            return rounds[name]
        return [rows[name]] if name in rows else []

    checks = []
    for name, versus, target, measure in pairs:
        check: dict[str, Any] = {
            "what": name,
            "versus": versus,
            "target": target,
            "measure": measure,
        }
        by_round = rounds if rounds is not None and len(rounds.get(name, ())) > 1 else None
        if measure == "fewest":
            share = _fewest(every_round(name))
            if share is not None:
                check["ratio"] = share
                check["met"] = share >= (target or 0.0)
                check["beside"] = _fewest(every_round(versus))
                if by_round is not None:
                    check["round_ratios"] = [result.fewest_share for result in by_round[name]]
            checks.append(check)
            continue
        ratio = _ratio(rows.get(name), rows.get(versus))
        if ratio is not None:
            check["ratio"] = ratio
            if target is not None:
                check["met"] = ratio >= target
            if by_round is not None:
                check["round_ratios"] = [
                    _ratio(mine, theirs)
                    for mine, theirs in zip(by_round[name], by_round.get(versus, []), strict=False)
                ]
        checks.append(check)
    return checks


def _fewest(results: list[Result]) -> float | None:
    """The median of the rounds' fewest shares (None if no round measured one)."""
    shares = [result.fewest_share for result in results if result.fewest_share is not None]
    return statistics.median(shares) if shares else None


def _ratio(row: Result | None, versus_row: Result | None) -> float | None:
    """`row`'s buys/s over `versus_row`'s; None where either is missing or the divisor is 0."""
    if row is None or versus_row is None or not versus_row.buys_per_second:
        return None
    return row.buys_per_second / versus_row.buys_per_second


def _kilobytes(value: float | None) -> float | None:
    return None if value is None else value / 1024


def _format(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def print_table(rows: list[Result], rounds: int) -> None:
    label = "median of " + str(rounds) + " rounds" if rounds > 1 else "one round"
    print(f"\nresults ({label}; cpu in ms per unit sold):")
    header = (
        f"{'contender':<27} {'buys/s':>7} {'sold':>6} {'busy':>5} {'oversold':>8} "
        f"{'remaining':>9} {'consistent':>10} {'cpu py':>7} {'cpu pg':>7} {'cpu redis':>9} "
        f"{'wal kB':>6} {'host cpu':>8} {'p50 ms':>7} {'p99 ms':>7} {'fewest':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        note = " (capped)" if row.capped else ""
        note += " ERRORS" if row.errors else ""
        print(
            f"{row.contender:<27} {row.buys_per_second:>7.0f} {row.sold:>6} {row.busy:>5} "
            f"{row.oversold:>8} {_format(row.remaining, 'd'):>9} "
            f"{'yes' if row.consistent else 'NO':>10} "
            f"{_format(row.client_cpu_ms_per_buy, '.2f'):>7} "
            f"{_format(row.postgres_cpu_ms_per_buy, '.2f'):>7} "
            f"{_format(row.redis_cpu_ms_per_buy, '.3f'):>9} "
            f"{_format(_kilobytes(row.wal_bytes_per_buy), '.2f'):>6} "
            f"{_format(None if row.host_cpu_busy is None else 100 * row.host_cpu_busy, '.0f'):>7}%"
            f" {_format(row.p50_ms, '.2f'):>7} {_format(row.p99_ms, '.1f'):>7}"
            f" {_format(row.fewest_share, '.2f'):>6}{note}"
        )
        for line in row.notes:
            print(f"    {line}")


def print_profile(rows: list[Result]) -> None:
    """Where the time goes, per unit sold, in milliseconds of buyer time (all buyers together:
    a phase that serializes checkouts cannot take more than 1000 / buys/s of it)."""
    print(
        "\nwhere the time goes (--profile), ms per unit sold summed over the buyers; "
        "'serial' = 1000 / buys/s, the time one unit takes when units are sold one at a time:"
    )
    header = f"{'contender':<27} {'serial':>7} {'checkout':>8}" + "".join(
        f" {heading:>9}" for _, heading in PROFILE_PHASES
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if not row.phases_ms_per_buy:
            continue
        serial = 1000 / row.buys_per_second if row.buys_per_second else None
        checkout = 1000 * row.buyers * row.seconds / row.sold if row.sold else None
        cells = "".join(
            f" {_format(row.phases_ms_per_buy.get(phase), '.2f'):>9}" for phase, _ in PROFILE_PHASES
        )
        print(
            f"{row.contender:<27} {_format(serial, '.2f'):>7} {_format(checkout, '.2f'):>8}{cells}"
        )
    print(
        "checkout: buyer time per unit sold (buyers x seconds / units). A phase close to 'serial' "
        "is where checkouts queue: the lock held, or the sale write (the item row is locked "
        "from its UPDATE to the commit that ends the statement)."
    )


def print_ratios(checks: list[dict[str, Any]]) -> None:
    print("\ntargets (buys/s ratios; fewest: the fewest units a buyer got, over an even share):")
    bounds = False
    for check in checks:
        if check["target"] is None and not bounds:
            bounds = True
            print(
                "other ratios (lua and segmented batched, their buyers threads of a few "
                "processes, against each buyer a process that takes and writes its own sales; "
                "lua against the hot row; then what the machine allows a buyer on its own: "
                "lua against its least possible work, a take plus the sale statement on a stock "
                "row, and that against the hot row, the sale statement alone on the item row):"
            )
        if "ratio" not in check:
            print(f"  {check['what']} vs {check['versus']}: not measured in this run")
            continue
        if check["measure"] == "fewest":
            what = f"{check['what']} fewest"
            line = (
                f"  {what:<24} {check['ratio']:>6.2f}   (target >= {check['target']:.2f}): "
                f"{'met' if check['met'] else 'MISSED'}; {check['versus']} fewest "
                f"{_format(check['beside'], '.2f')}"
            )
            suffix = ""
        else:
            line = f"  {check['what']:<24} vs {check['versus']:<27} {check['ratio']:>6.2f}x"
            if check["target"] is not None:
                verdict = "met" if check["met"] else "MISSED"
                line += f"  (target >= {check['target']:.2f}x): {verdict}"
            suffix = "x"
        if check.get("round_ratios"):
            line += "; rounds: " + ", ".join(
                _format(ratio, ".2f") + (suffix if ratio is not None else "")
                for ratio in check["round_ratios"]
            )
        print(line)


def crowd_ratios(rows: dict[str, Result], buyers: int, crowds: list[int]) -> list[dict[str, Any]]:
    """`lua, batched` against the hot row at each crowd measured (--buyers and --crowds), and
    against the hot row at the crowd where it sold most in the run (its best: the ceiling of
    any design that has every buyer write one row, whatever its crowd). Empty without
    --crowds."""
    if not crowds:
        return []

    def row(name: str, crowd: int) -> Result | None:
        return rows.get(name if crowd == buyers else at_crowd(name, crowd))

    measured = sorted({buyers, *crowds})
    hot_rows = {crowd: hot for crowd in measured if (hot := row(HOT_ROW, crowd)) is not None}
    best = max(hot_rows, key=lambda crowd: hot_rows[crowd].buys_per_second, default=None)
    best_row = None if best is None else hot_rows[best]
    table = []
    for crowd in measured:
        batched, hot_row = row(LUA_BATCHED, crowd), hot_rows.get(crowd)
        table.append(
            {
                "buyers": crowd,
                "batched": None if batched is None else batched.buys_per_second,
                "hot_row": None if hot_row is None else hot_row.buys_per_second,
                "ratio": _ratio(batched, hot_row),
                "best_hot_row_buyers": best,
                "versus_best": _ratio(batched, best_row),
            }
        )
    return table


def print_crowds(table: list[dict[str, Any]], processes: int) -> None:
    best = table[0]["best_hot_row_buyers"]
    print(
        f"\ncrowds (buys/s; {LUA_BATCHED}: {processes} processes, the buyers their threads; "
        f"the hot row: a process a buyer; best: the hot row at {best} buyers, where it sold "
        "most in this run):"
    )
    header = f"  {'buyers':>6} {LUA_BATCHED:>13} {'hot row':>8} {'ratio':>7} {'vs best':>8}"
    print(header)
    for line in table:
        print(
            f"  {line['buyers']:>6} {_format(line['batched'], '.0f'):>13} "
            f"{_format(line['hot_row'], '.0f'):>8} "
            f"{_times(line['ratio']):>7} {_times(line['versus_best']):>8}"
        )
