"""The tests' own promise: they wait on events or poll with a deadline.

On a loaded machine a fixed sleep is too short and an upper bound on elapsed time too tight, and
either fails a test whose behaviour is right. So no test sleeps right before an assertion, and
none bounds an elapsed time from above by a fixed figure. A lower bound (the waiter waited at
least the lease) proves behaviour and is fine; so is comparing two times measured in the same
test (an event before another, one wait shorter than another).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: The clock readings of the `time` module.
CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns"}
#: Names that hold an elapsed time however it was measured.
ELAPSED = {"elapsed", "waited", "duration", "took", "latency"}

MOMENT, SPAN = "a clock reading", "an elapsed time"


def _is_clock_reading(node: ast.AST) -> bool:
    """`time.monotonic()` and the like, or a clock imported by name (`monotonic()`)."""
    if not isinstance(node, ast.Call) or node.args:
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}


def _is_sleep(statement: ast.stmt) -> bool:
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return False
    func = statement.value.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id == "sleep"


class _Times:
    """What the names of one function hold: a clock reading, an elapsed time, or neither."""

    def __init__(self, function: ast.AST) -> None:
        self.names: dict[str, str] = {}
        assignments = [
            (node.targets[0].id, node.value)
            for node in ast.walk(function)
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ]
        for _ in range(3):  # a name may be made of names assigned further down the walk
            for name, value in assignments:
                kind = self.kind(value)
                if kind is not None:
                    self.names[name] = kind

    def kind(self, node: ast.AST) -> str | None:
        if _is_clock_reading(node):
            return MOMENT
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            # tests.support.run_in_thread's outcome["at"]: when the thread ended
            return MOMENT if node.slice.value == "at" else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            left, right = self.kind(node.left), self.kind(node.right)
            if isinstance(node.op, ast.Sub) and left == right == MOMENT:
                return SPAN
            if MOMENT in (left, right):
                return MOMENT
            return SPAN if SPAN in (left, right) else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("min", "max") and node.args:
                first = node.args[0]
                if isinstance(first, ast.GeneratorExp | ast.ListComp):
                    first = first.elt
                return self.kind(first)
        return None

    def bounds_elapsed_time(self, below: ast.AST, above: ast.AST) -> bool:
        """Whether `below < above` holds an elapsed time under a fixed figure."""
        if self.kind(above) in (MOMENT, SPAN):
            # two measured times compared, unless a figure is added to the later one
            return (
                self.kind(below) == MOMENT
                and isinstance(above, ast.BinOp)
                and isinstance(above.op, ast.Add | ast.Sub)
                and None in (self.kind(above.left), self.kind(above.right))
            )
        if self.kind(below) == SPAN:
            return True
        name = below.id if isinstance(below, ast.Name) else getattr(below, "attr", "")
        return name.split("_")[0] in ELAPSED


def _findings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each sleep right before an assertion and each elapsed time bounded
    from above in `tree`."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            for statement, following in zip(statements, statements[1:], strict=False):
                if _is_sleep(statement) and isinstance(following, ast.Assert):
                    found.add((statement.lineno, "a fixed sleep right before an assertion"))
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        times = _Times(node)
        for check in ast.walk(node):
            if not isinstance(check, ast.Assert):
                continue
            for compare in ast.walk(check.test):
                if not isinstance(compare, ast.Compare):
                    continue
                sides = [compare.left, *compare.comparators]
                for left, op, right in zip(sides, compare.ops, sides[1:], strict=False):
                    if isinstance(op, ast.Lt | ast.LtE):
                        below, above = left, right
                    elif isinstance(op, ast.Gt | ast.GtE):
                        below, above = right, left
                    else:
                        continue
                    if times.bounds_elapsed_time(below, above):
                        found.add((check.lineno, "an upper bound on elapsed time"))
    return sorted(found)


def test_no_test_sleeps_before_an_assertion_or_bounds_elapsed_time_from_above():
    scanned = 0
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        scanned += 1
        for line, what in _findings(ast.parse(path.read_text(), filename=str(path))):
            offences.append(f"{path.relative_to(TESTS.parent)}:{line}: {what}")
    assert scanned > 80
    assert offences == [], "wait on an event or poll with a deadline:\n" + "\n".join(offences)


def test_the_scan_finds_what_it_forbids_and_passes_what_it_allows():
    source = """
def test_example(outcome, deadline, result):
    started = time.monotonic()
    work()
    waited = time.monotonic() - started
    assert 0.45 < waited < 1.5
    assert time.monotonic() - started < 60
    assert outcome["at"] - started < 0.1
    assert min(outcome["at"] for outcome in outcomes) < started + 1.5
    assert 2 > result.elapsed
    time.sleep(0.3)
    assert done
    assert waited > 0.4
    assert outcome["at"] - started >= 0.3
    assert started + 0.15 < outcome["at"]
    assert time.monotonic() < deadline
    assert waited < time.monotonic() - started
    time.sleep(0.3)
    finished = done
    assert finished
"""
    assert _findings(ast.parse(source)) == [
        (6, "an upper bound on elapsed time"),
        (7, "an upper bound on elapsed time"),
        (8, "an upper bound on elapsed time"),
        (9, "an upper bound on elapsed time"),
        (10, "an upper bound on elapsed time"),
        (11, "a fixed sleep right before an assertion"),
    ]
