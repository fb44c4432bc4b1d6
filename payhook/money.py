"""Amounts in minor units, from the decimal strings some gateways send.

PayPal, Braintree and Mollie write amounts as decimal strings (`"10.50"`);
payhook keeps every amount as a whole number of the currency's minor units.
The conversion goes through the currency's exponent (ISO 4217: JPY 0, EUR 2,
KWD 3), from this one table, and is exact: digits are read as digits, never
through a float, and an amount finer than the currency's minor unit is
refused rather than rounded.
"""

from __future__ import annotations

import re

#: Currencies with no minor unit (ISO 4217).
ZERO_DECIMALS = "BIF CLP DJF GNF ISK JPY KMF KRW PYG RWF UGX UYI VND VUV XAF XOF XPF"
#: ISO 4217 minor-unit exponents other than 2; every other currency has 2.
EXPONENTS: dict[str, int] = {
    **dict.fromkeys(ZERO_DECIMALS.split(), 0),
    # Thousandths.
    **dict.fromkeys("BHD IQD JOD KWD LYD OMR TND".split(), 3),
    # Ten-thousandths (units of account).
    **dict.fromkeys("CLF UYW".split(), 4),
}
#: The default exponent.
DEFAULT_EXPONENT = 2
#: Minor units an amount stays below, as everywhere in payhook.
MAX_MINOR_UNITS = 2**62
#: A plain non-negative decimal: digits, then optionally a point and digits
#: (bounded: no amount below MAX_MINOR_UNITS is written with more).
DECIMAL = re.compile(r"(\d{1,19})(?:\.(\d{1,19}))?")


def exponent(currency: str) -> int:
    """How many decimal places `currency`'s minor unit is (ISO 4217)."""
    return EXPONENTS.get(currency.upper(), DEFAULT_EXPONENT)


def minor_units(amount: str, currency: str) -> int:
    """`amount`, a decimal string such as `"10.50"`, in minor units of `currency`.

    ValueError when it is not a plain non-negative decimal (no sign, exponent,
    spaces or thousands separators), or when it is finer than the currency's
    minor unit (`"10.505"` EUR; `"1.5"` JPY); zeros past the minor unit are
    allowed (`"10.500"` EUR is 1050).
    """
    match = DECIMAL.fullmatch(amount) if amount.isascii() else None
    if match is None:
        raise ValueError("expected a plain decimal amount such as 10.50")
    whole, fraction = match.group(1), (match.group(2) or "")
    places = exponent(currency)
    kept, rest = fraction[:places], fraction[places:]
    if rest.strip("0"):
        raise ValueError(f"finer than the minor unit of {currency.upper()} ({places} decimals)")
    scale: int = 10**places
    minor = int(whole) * scale + int(kept.ljust(places, "0") or "0")
    if minor >= MAX_MINOR_UNITS:
        raise ValueError("too large an amount")
    return minor


def decimal_string(minor: int, currency: str) -> str:
    """`minor` units of `currency` as the gateways write them (`"10.50"`,
    `"1050"` JPY): the reverse of `minor_units`."""
    places = exponent(currency)
    if places == 0:
        return str(minor)
    whole, fraction = divmod(minor, 10**places)
    return f"{whole}.{fraction:0{places}d}"
