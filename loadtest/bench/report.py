"""The printed results: medians, the table, where the time goes, the targets and bounds."""

from __future__ import annotations

import statistics
from typing import Any

from .contenders import (
    BOUNDS,
    HOT_ROW,
    LUA_GROUPED,
    LUA_UNGROUPED,
    TARGETS,
    WORK_TARGET,
    Result,
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
    gives its ratio in every round (`round_ratios`), so that a median's spread shows."""
    pairs: list[tuple[str, str, float | None, str]] = list(TARGETS)
    if work_ms:
        pairs.insert(
            3, (with_work("segmented", work_ms), with_work("lock", work_ms), WORK_TARGET, "rate")
        )
    pairs += [(name, versus, None, "rate") for name, versus in BOUNDS]
    pairs += [
        ("lua", variant, None, "rate")
        for variant in (LUA_GROUPED, LUA_UNGROUPED)
        if variant in rows
    ]
    checks = []
    for name, versus, target, measure in pairs:
        row, versus_row = rows.get(name), rows.get(versus)
        check: dict[str, Any] = {
            "what": name,
            "versus": versus,
            "target": target,
            "measure": measure,
        }
        ratio = _ratio(row, versus_row, measure)
        by_round = rounds if rounds is not None and len(rounds.get(name, ())) > 1 else None
        if ratio is not None and by_round is not None:
            check["round_ratios"] = [
                _ratio(mine, theirs, measure)
                for mine, theirs in zip(by_round[name], by_round.get(versus, []), strict=False)
            ]
        if measure == "p99":
            if ratio is not None and row is not None and versus_row and versus_row.p99_ms:
                limit = target or 0.0
                versus_p99 = versus_row.p99_ms
                if by_round is not None:
                    # A median row is the round of the median rate; a p99's median is the
                    # median of the rounds' p99s, whichever rounds they came from.
                    mine, theirs = median_p99(by_round[name]), median_p99(by_round.get(versus, []))
                    if mine is not None and theirs:
                        ratio, versus_p99 = mine / theirs, theirs
                        check["p99_medians"] = {name: mine, versus: theirs}
                check["ratio"] = ratio
                check["met"] = ratio <= limit
                check["tail"] = {
                    name: (row.p999_ms, row.longest_ms),
                    versus: (versus_row.p999_ms, versus_row.longest_ms),
                }
                check["even_share"] = even_share(
                    row, versus_row, versus_p99 * limit, rows.get(HOT_ROW)
                )
        elif ratio is not None:
            check["ratio"] = ratio
            if target is not None:
                check["met"] = ratio >= target
        checks.append(check)
    return checks


def median_p99(results: list[Result]) -> float | None:
    """The median of the rounds' p99 times per sale (None if no round measured one)."""
    p99s = [result.p99_ms for result in results if result.p99_ms is not None]
    return statistics.median(p99s) if p99s else None


def _ratio(row: Result | None, versus_row: Result | None, measure: str) -> float | None:
    """`row`'s buys/s over `versus_row`'s, or its p99 over theirs; None where either is
    missing or the divisor is 0."""
    if row is None or versus_row is None:
        return None
    if measure == "p99":
        if not (row.p99_ms and versus_row.p99_ms):
            return None
        return row.p99_ms / versus_row.p99_ms
    if not versus_row.buys_per_second:
        return None
    return row.buys_per_second / versus_row.buys_per_second


def even_share(
    row: Result, versus_row: Result, p99_ms: float, ceiling: Result | None
) -> dict[str, Any]:
    """What a p99 target of `p99_ms` (set by `versus_row`'s) asks of `row`, a lock that serves
    its buyers in turn.
    Every buyer buys again as soon as it has bought, so by Little's law a sale takes buyers /
    buys/s on average, whatever the lock. One that hands itself to its longest waiter keeps
    each sale near that mean, so its p99 is no lower (a p99 below the mean is a tail carried by
    under 1% of the sales: buyers left waiting). Hence the buys/s it needs for that p99:
    buyers / p99, here also as a multiple of `ceiling`'s (the hot row)."""
    needed = row.buyers / (p99_ms / 1000) if p99_ms else float("inf")
    return {
        "mean_ms": mean_ms(row),
        "versus_mean_ms": mean_ms(versus_row),
        "p99_ms": p99_ms,
        "needed": needed,
        "ceiling": (ceiling.contender, needed / ceiling.buys_per_second)
        if ceiling is not None and ceiling.buys_per_second
        else None,
    }


def mean_ms(row: Result) -> float | None:
    """How long a sale took on average, by Little's law: buyers / buys/s (every buyer buys
    again as soon as it has bought)."""
    return 1000 * row.buyers / row.buys_per_second if row.buys_per_second else None


def _kilobytes(value: float | None) -> float | None:
    return None if value is None else value / 1024


def _format(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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
    print("\ntargets (buys/s ratios, and p99 time per sale where marked):")
    bounds = False
    for check in checks:
        if check["target"] is None and not bounds:
            bounds = True
            print(
                "other ratios (segmented with its shard holders' sales written by the sale "
                "writer, against lock and against each holder writing its own; lua with each "
                "buyer taking and writing its own sales, against the hot row and the sale "
                "writer; then what the machine allows a buyer on its own: "
                "lua against its least possible work, a take plus the sale statement on a stock "
                "row, and that against the hot row, the sale statement alone on the item row):"
            )
        if "ratio" not in check:
            print(f"  {check['what']} vs {check['versus']}: not measured in this run")
            continue
        what = check["what"] + (" p99" if check["measure"] == "p99" else "")
        line = f"  {what:<24} vs {check['versus']:<27} {check['ratio']:>6.2f}x"
        if check["target"] is not None:
            verdict = "met" if check["met"] else "MISSED"
            sign = "<=" if check["measure"] == "p99" else ">="
            line += f"  (target {sign} {check['target']:.2f}x): {verdict}"
        if check.get("round_ratios"):
            line += "; rounds: " + ", ".join(
                _format(ratio, ".2f") + ("x" if ratio is not None else "")
                for ratio in check["round_ratios"]
            )
        print(line)
        if "p99_medians" in check:
            print(
                "    the medians of the rounds' p99s, ms: "
                + ", ".join(f"{name} {p99:.1f}" for name, p99 in check["p99_medians"].items())
                + " (the table's p99 is that of the round of the median rate)"
            )
        if "tail" in check:
            print(
                "    its tail, ms: "
                + "; ".join(
                    f"{name} p99.9 {_format(p999, '.1f')}, longest {_format(longest, '.1f')}"
                    for name, (p999, longest) in check["tail"].items()
                )
            )
        if "even_share" in check:
            share = check["even_share"]
            line = (
                f"    a sale takes buyers / buys/s on average: {check['what']} "
                f"{_format(share['mean_ms'], '.1f')} ms, {check['versus']} "
                f"{_format(share['versus_mean_ms'], '.1f')}; serving its buyers in turn keeps "
                f"{check['what']}'s p99 at or above its mean, so a p99 of "
                f"{share['p99_ms']:.2f} ms needs {share['needed']:,.0f} buys/s"
            )
            if share["ceiling"] is not None:
                ceiling, times = share["ceiling"]
                line += f", {times:.2f}x the {ceiling}"
            print(line)
