"""Decimal amounts to minor units, by the currency's exponent, exactly."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payhook.money import EXPONENTS, exponent, minor_units


@pytest.mark.parametrize(
    ("amount", "currency", "expected"),
    [
        ("10.50", "EUR", 1050),
        ("10.5", "eur", 1050),
        ("10", "EUR", 1000),
        ("0.01", "USD", 1),
        ("10.500", "EUR", 1050),
        ("1500", "JPY", 1500),
        ("1500.00", "JPY", 1500),
        ("1.234", "KWD", 1234),
        ("1.2", "BHD", 1200),
        ("0.0001", "CLF", 1),
        ("99999999999999.99", "EUR", 9_999_999_999_999_999),
        # A float would give 1004.9999999999999 and 1004.
        ("10.05", "EUR", 1005),
        ("0.29", "EUR", 29),
    ],
)
def test_an_amount_is_read_exactly_in_the_currencys_minor_units(
    amount: str, currency: str, expected: int
) -> None:
    assert minor_units(amount, currency) == expected


@pytest.mark.parametrize(
    ("amount", "currency", "reason"),
    [
        ("10.505", "EUR", "finer than the minor unit of EUR"),
        ("1.5", "JPY", "finer than the minor unit of JPY"),
        ("1.2345", "KWD", "finer than the minor unit of KWD"),
        ("-1.00", "EUR", "plain decimal"),
        ("+1.00", "EUR", "plain decimal"),
        ("1e3", "EUR", "plain decimal"),
        ("1,000.00", "EUR", "plain decimal"),
        (" 1.00", "EUR", "plain decimal"),
        ("1.", "EUR", "plain decimal"),
        (".5", "EUR", "plain decimal"),
        ("", "EUR", "plain decimal"),
        ("NaN", "EUR", "plain decimal"),
        ("\u0661\u0660", "EUR", "plain decimal"),  # Arabic-Indic digits: not ASCII
        ("1" * 20, "JPY", "plain decimal"),
        ("46116860184273879.04", "EUR", "too large"),
    ],
)
def test_anything_else_is_refused_never_rounded(amount: str, currency: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        minor_units(amount, currency)


def test_exponents_come_from_one_table() -> None:
    assert (exponent("JPY"), exponent("EUR"), exponent("KWD"), exponent("clf")) == (0, 2, 3, 4)
    assert exponent("XYZ") == 2
    assert set(EXPONENTS.values()) == {0, 3, 4}


@given(
    cents=st.integers(min_value=0, max_value=2**62 - 1),
    currency=st.sampled_from(["EUR", "JPY", "KWD", "CLF", "USD"]),
)
def test_what_the_minor_units_print_as_reads_back(cents: int, currency: str) -> None:
    places = exponent(currency)
    text = str(Decimal(cents).scaleb(-places).quantize(Decimal(1).scaleb(-places)))
    assert minor_units(text, currency) == cents
