"""Model prices: the genai-prices bundled snapshot, under an overrides file for private models.

rates.py is what a model costs per unit and what a call was billed for (Rates, Usage);
table.py the PriceTable that looks a model up, keeps the prices fresh and prices a call's worst
case and its cost; prices_file.py reads CEILING_PRICES_FILE; bundled.py reads genai-prices.
"""

from core.prices.bundled import BUNDLED_WINDOW_S, bedrock_price_key
from core.prices.prices_file import load_prices_file
from core.prices.rates import (
    SEARCH_EVERY_CALL_FAMILY,
    TIER_AUTO,
    TIER_DEFAULT,
    Rates,
    Tiers,
    Usage,
    check_service_tier,
    max_tiers,
)
from core.prices.table import PriceTable

__all__ = [
    "BUNDLED_WINDOW_S",
    "SEARCH_EVERY_CALL_FAMILY",
    "TIER_AUTO",
    "TIER_DEFAULT",
    "PriceTable",
    "Rates",
    "Tiers",
    "Usage",
    "bedrock_price_key",
    "check_service_tier",
    "load_prices_file",
    "max_tiers",
]
