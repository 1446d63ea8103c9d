from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.errors import InvalidRequest
from core.money import charge_micros, micros_to_usd, usd_to_micros


@pytest.mark.parametrize(
    ("usd", "micros"),
    [("0.05", 50_000), ("1", 1_000_000), ("0.0000001", 1), ("0", 0), ("1.0000001", 1_000_001)],
)
def test_dollars_parse_to_micros_rounding_a_charge_up(usd: str, micros: int) -> None:
    assert usd_to_micros(usd) == micros


@pytest.mark.parametrize("bad", ["-0.01", "abc", "NaN", "Infinity", "1e30", ""])
def test_bad_dollar_amounts_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        usd_to_micros(bad)


def test_a_cost_above_zero_is_at_least_one_micro() -> None:
    assert charge_micros(Decimal("0.02")) == 1
    assert charge_micros(Decimal("0")) == 0
    assert charge_micros(Decimal("2.000001")) == 3


def test_twenty_nickels_are_exactly_a_dollar() -> None:
    assert sum(usd_to_micros("0.05") for _ in range(20)) == usd_to_micros("1.00")
    assert micros_to_usd(50_000) == "0.050000"


@given(st.integers(min_value=-(2**53), max_value=2**53))
def test_micros_format_as_the_exact_dollar_amount(micros: int) -> None:
    usd = micros_to_usd(micros)
    assert Decimal(usd) * 1_000_000 == micros
    assert usd == str((Decimal(micros) / 1_000_000).quantize(Decimal("0.000001")))
