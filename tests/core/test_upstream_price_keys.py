"""The name each routed call is priced by (core/upstreams.py price_key, core/prices
bedrock_price_key): where the call runs decides the rate, so the name the table prices must say
where. Read from genai-prices' bundled table, with no prices file."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from core.errors import ModelUnpriced
from core.prices import PriceTable, bedrock_price_key
from core.upstreams import parse

SONNET_ID = "anthropic.claude-sonnet-4-5-20250929-v1:0"
REGIONAL, GLOBAL = f"regional.{SONNET_ID}", f"global.{SONNET_ID}"
ENV = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret"}


@pytest.mark.parametrize(("model_id", "key"), [
    (SONNET_ID, REGIONAL),  # a base id runs in the caller's region
    (f"us.{SONNET_ID}", REGIONAL),
    (f"eu.{SONNET_ID}", REGIONAL),
    (f"apac.{SONNET_ID}", REGIONAL),
    (f"us-gov.{SONNET_ID}", REGIONAL),
    (GLOBAL, GLOBAL),
    (f"arn:aws:bedrock:us-east-1:123456789012:inference-profile/eu.{SONNET_ID}", REGIONAL),
    (f"arn:aws:bedrock:us-east-1::foundation-model/{SONNET_ID}", REGIONAL),
    ("amazon.nova-pro-v1:0", "amazon.nova-pro-v1:0"),  # not Claude: its own name
])
def test_a_bedrock_model_id_is_priced_by_where_it_runs(model_id: str, key: str) -> None:
    assert bedrock_price_key(model_id) == key


def test_the_regional_entry_is_found_and_is_ten_percent_above_global() -> None:
    table = PriceTable()
    regional, global_ = table.rates(REGIONAL, "aws"), table.rates(GLOBAL, "aws")
    assert (regional.input, regional.output) == (((0, Decimal("3.3")),), ((0, Decimal("16.5")),))
    assert (global_.input, global_.output) == (((0, Decimal("3")),), ((0, Decimal("15")),))


def test_a_bedrock_upstream_holds_by_the_entry_of_its_model_id() -> None:
    upstreams = parse({"upstreams": [{
        "name": "bedrock", "api": "bedrock", "region": "eu-west-1",
        "model_ids": {"claude-sonnet-4-5": f"eu.{SONNET_ID}", "sonnet-global": GLOBAL}}]}, ENV)
    routed = upstreams.resolve("claude-sonnet-4-5", "messages")
    assert (routed.priced_model, routed.sent_model, routed.price_model) == (
        "claude-sonnet-4-5", f"eu.{SONNET_ID}", REGIONAL)
    assert upstreams.resolve(f"eu.{SONNET_ID}", "messages").price_model == REGIONAL
    assert upstreams.resolve("bedrock/sonnet-global", "messages").price_model == GLOBAL


def test_vertex_claude_is_priced_by_its_dated_name_and_regionally_only_by_the_prices_file(
        tmp_path: Path) -> None:
    account = tmp_path / "sa.json"
    account.write_text("{}")
    vertex = {"api": "vertex", "project": "p", "credentials_file": str(account),
              "models": ["claude-sonnet-4-5@20250929", "gemini-2.5-flash"]}
    upstreams = parse({"upstreams": [{"name": "vg", "region": "global", **vertex},
                                     {"name": "ve", "region": "us-east5", **vertex}]}, {})
    on_global = upstreams.resolve("vg/claude-sonnet-4-5@20250929", "messages")
    on_region = upstreams.resolve("ve/claude-sonnet-4-5@20250929", "messages")
    assert on_global.sent_model == on_region.sent_model == "claude-sonnet-4-5@20250929"
    assert on_global.price_model == "claude-sonnet-4-5-20250929"
    assert on_region.price_model == "regional.claude-sonnet-4-5-20250929"
    assert upstreams.resolve("ve/gemini-2.5-flash", "gemini").price_model == "gemini-2.5-flash"
    table = PriceTable()
    assert table.rates(on_global.price_model, "google").input[0][1] == Decimal("3")
    with pytest.raises(ModelUnpriced):  # no bundled table has the regional rate
        table.rates(on_region.price_model, "google")


def test_other_upstreams_price_the_priced_model() -> None:
    upstreams = parse({"upstreams": [
        {"name": "az", "api": "azure", "base_url": "https://r.openai.azure.com/openai/v1",
         "deployments": {"prod-mini": "gpt-5-mini"}},
        {"name": "or", "api": "openai", "base_url": "https://openrouter.ai/api/v1",
         "models": ["openai/gpt-5"]}]}, {})
    assert upstreams.resolve("prod-mini", "chat").price_model == "gpt-5-mini"
    assert upstreams.resolve("openai/gpt-5", "chat").price_model == "openai/gpt-5"


def test_a_claude_id_listed_in_models_is_its_model_and_each_profile_prices_apart() -> None:
    """Listed in `models` (no model_ids), a Claude id is priced (and counted) as its model, and
    two profiles of that one model keep their own rates: the key is the name the call named."""
    upstreams = parse({"upstreams": [{
        "name": "bedrock", "api": "bedrock", "region": "us-east-1",
        "models": [f"us.{SONNET_ID}", GLOBAL, "amazon.nova-pro-v1:0"]}]}, ENV)
    regional, global_ = (upstreams.resolve(f"us.{SONNET_ID}", "messages"),
                         upstreams.resolve(GLOBAL, "messages"))
    assert (regional.priced_model, regional.sent_model, regional.price_model) == (
        "claude-sonnet-4-5-20250929", f"us.{SONNET_ID}", REGIONAL)
    assert (global_.priced_model, global_.sent_model, global_.price_model) == (
        "claude-sonnet-4-5-20250929", GLOBAL, GLOBAL)
    assert PriceTable().model_name(regional.priced_model, "aws") == "claude-sonnet-4-5"
    nova = upstreams.resolve("amazon.nova-pro-v1:0", "messages")
    assert (nova.priced_model, nova.price_model) == ("amazon.nova-pro-v1:0",) * 2


def test_a_routers_name_is_the_vendors_model_only_where_it_prices_it_so() -> None:
    table = PriceTable()
    assert table.model_name("openai/gpt-5", "openrouter") == "gpt-5"
    assert table.model_name("openai/gpt-4o", "openrouter") == "gpt-4o"
    # Not by its table's word alone: no provider, no router.
    assert table.model_name("openai/gpt-5") is None
