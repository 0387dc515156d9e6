"""`shop.environment.bounded`: a number from the environment within its bounds, or a refusal
that names the variable, its bounds and what it was given."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from shop.environment import bounded


def test_an_unset_variable_gives_the_default():
    assert bounded("FLASHSALE_X", 500, 0, 60_000, environ={}) == 500


@pytest.mark.parametrize(
    ("default", "low", "high", "raw", "expected"),
    [
        (500, 0, 60_000, "0", 0),
        (500, 0, 60_000, "60000", 60_000),
        (500, 0, 60_000, " 250 ", 250),
        (0.5, 0.01, 10.0, "0.3", 0.3),
        (0.5, 0.01, 10.0, "2", 2.0),
    ],
)
def test_a_value_within_its_bounds_is_read_as_the_defaults_type(default, low, high, raw, expected):
    value = bounded("FLASHSALE_X", default, low, high, environ={"FLASHSALE_X": raw})
    assert value == expected and type(value) is type(default)


@pytest.mark.parametrize(
    ("default", "low", "high", "raw"),
    [
        (500, 0, 60_000, "-1"),
        (500, 0, 60_000, "60001"),
        (500, 0, 60_000, "x"),
        (500, 0, 60_000, ""),
        (500, 0, 60_000, "2.5"),  # a whole number is required
        (0.5, 0.01, 10.0, "0"),
        (0.5, 0.01, 10.0, "nan"),
        (0.5, 0.01, 10.0, "inf"),
    ],
)
def test_a_value_out_of_its_bounds_or_no_number_is_refused_by_name(default, low, high, raw):
    with pytest.raises(ImproperlyConfigured) as refused:
        bounded("FLASHSALE_X", default, low, high, environ={"FLASHSALE_X": raw})
    assert str(refused.value) == f"FLASHSALE_X must be from {low} to {high}, not {raw}"
