"""Argument types the benchmarks share."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low` (and at most `high`, when given)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if high is None and number < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}")
        if high is not None and not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}")
        return number

    return parse
