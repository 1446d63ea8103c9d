import json
from decimal import Decimal
from pathlib import Path

import pytest

from core.errors import InvalidRequest, ModelUnpriced
from core.prices import PriceTable, Rates, Usage


@pytest.fixture
def prices(tmp_path: Path) -> PriceTable:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {
        "acme-llm": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "2.00",
                     "cached_input_usd_per_mtok": "0.10"},
        "gpt-4o": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "1.00"},
    }}))
    return PriceTable.from_file(str(path))


def test_worst_case_is_input_plus_output_cap_times_choices(prices: PriceTable) -> None:
    assert prices.worst_case_micros("acme-llm", 1_000, 500, 3) == 1_000 * 1 + 500 * 3 * 2


def test_cost_rounds_up_and_prices_cached_tokens(prices: PriceTable) -> None:
    assert prices.cost_micros("acme-llm", Usage(1_000, 10, 400)) == 600 + 40 + 20
    assert prices.cost_micros("ACME-LLM", Usage(1, 0, 1)) == 1  # 0.1 micro rounds up to 1


def test_overrides_win_over_the_bundled_table(prices: PriceTable) -> None:
    assert prices.worst_case_micros("gpt-4o", 100, 100) == 200
    assert "+overrides." in prices.version


def test_the_bundled_table_prices_known_models() -> None:
    table = PriceTable()
    # gpt-4o: $2.50 in, $10 out per million tokens.
    assert table.worst_case_micros("gpt-4o", 1_000, 500, 2) == 2_500 + 10_000
    assert table.version.startswith("genai-prices-")


def test_an_unknown_model_is_refused_never_free() -> None:
    with pytest.raises(ModelUnpriced) as info:
        PriceTable().rates("brand-new-model-9000")
    assert info.value.code == "model_unpriced"


def test_tiers_charge_the_highest_rate_in_the_worst_case() -> None:
    tiers = ((0, Decimal("1")), (200_000, Decimal("2")))
    assert Rates.at(tiers, 200_000) == 1
    assert Rates.at(tiers, 200_001) == 2


@pytest.mark.parametrize("tokens", [-1, 1.5, "10", True, 10**9])
def test_bad_token_counts_are_refused(prices: PriceTable, tokens: object) -> None:
    with pytest.raises(InvalidRequest):
        prices.worst_case_micros("acme-llm", tokens, 10)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        prices.worst_case_micros("acme-llm", 10, tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "doc",
    [{"models": {"m": {"input_usd_per_mtok": 1.0}}},
     {"models": {"m": {"input_usd_per_mtok": "-1"}}},
     {"models": {"m": {"output_usd_per_mtok": "1"}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "typo": "1"}}},
     {"modles": {}}],
)
def test_a_bad_prices_file_is_refused(tmp_path: Path, doc: object) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidRequest):
        PriceTable.from_file(str(path))
