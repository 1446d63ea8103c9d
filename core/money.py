"""Money is integer micro-dollars. Dollars pass through Decimal only at the edges."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal, InvalidOperation

from core.errors import InvalidRequest
from core.limits import AMOUNT_MICROS_MAX

MICROS_PER_USD = 1_000_000


def charge_micros(exact_micros: Decimal) -> int:
    """Round a non-negative exact cost up to whole micro-dollars: a cost above zero is >= 1."""
    return int(exact_micros.to_integral_value(rounding=ROUND_CEILING))


def usd_to_micros(usd: str) -> int:
    """Parse a decimal dollar string ('0.05') into micro-dollars, rounding a charge up."""
    try:
        value = Decimal(usd)
    except InvalidOperation as exc:
        raise InvalidRequest(f"not a dollar amount: {usd!r}") from exc
    if not value.is_finite() or value < 0:
        raise InvalidRequest(f"not a dollar amount: {usd!r}")
    micros = charge_micros(value * MICROS_PER_USD)
    if micros > AMOUNT_MICROS_MAX:
        raise InvalidRequest(f"dollar amount above the limit: {usd!r}")
    return micros


def micros_to_usd(micros: int) -> str:
    """Format micro-dollars as an exact dollar string: 50_000 -> '0.050000'."""
    # Integer arithmetic: as exact as Decimal, and cheaper on a path every reserve's answer takes.
    whole, fraction = divmod(abs(micros), MICROS_PER_USD)
    return f"{'-' if micros < 0 else ''}{whole}.{fraction:06d}"
