"""Prices: every rate kind, service tiers, the prices file, reloading, and the one property that
matters: no usage a request can produce costs more than the request's worst case.

Every figure is worked by hand in the test from the rates written beside it. Rates are USD per
million tokens, which is micro-dollars per token: 1,000 tokens at "2.00" cost 2,000 micros.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import core.prices
import core.prices.table
from core.content import NO_MEDIA, ImageBound, Media
from core.errors import InputUnbounded, InvalidRequest, ModelUnbounded, ModelUnpriced
from core.prices import (
    BUNDLED_WINDOW_S,
    PriceTable,
    Rates,
    Tiers,
    Usage,
    load_prices_file,
    max_tiers,
)
from tests.support import examples

MODELS: dict[str, Any] = {
    "acme-llm": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "2.00",
                 "cached_input_usd_per_mtok": "0.10"},
    "gpt-4o": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "1.00"},
    "m-cache": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                "cached_input_usd_per_mtok": "0.1", "cache_write_usd_per_mtok": "1.25",
                "cache_write_1h_usd_per_mtok": "2"},
    "m-audio": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                "cached_input_usd_per_mtok": "0.1", "input_audio_usd_per_mtok": "10",
                "cached_input_audio_usd_per_mtok": "1", "output_audio_usd_per_mtok": "20",
                "audio_input_tokens_per_s": 10},
    "m-fee": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1",
              "usd_per_request": "0.002"},
    "m-tiers": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                "service_tiers": {"priority": {"input_usd_per_mtok": "3",
                                               "output_usd_per_mtok": "6"},
                                  "flex": {"input_usd_per_mtok": "0.5",
                                           "output_usd_per_mtok": "1"}}},
    "m-image": {"input_usd_per_mtok": "2", "output_usd_per_mtok": "2",
                "image_input_tokens_max": {"low": 100, "high": 1000}},
    "m-text": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1"},
}
# 2026-12-01 11:00 UTC: OpenAI's priority rates (from 2026-10-12 in genai-prices) in force.
DECEMBER_S = datetime(2026, 12, 1, 11, 0, tzinfo=UTC).timestamp()


def write(path: Path, models: dict[str, Any]) -> None:
    path.write_text(json.dumps({"models": models}))


@pytest.fixture
def prices(tmp_path: Path) -> PriceTable:
    path = tmp_path / "prices.json"
    write(path, MODELS)
    return PriceTable.from_file(str(path), now_s=lambda: DECEMBER_S)


# -- the rates ----------------------------------------------------------------------------------


def test_worst_case_is_input_plus_output_cap_times_choices(prices: PriceTable) -> None:
    assert prices.worst_case_micros("acme-llm", 1_000, 500, 3) == 1_000 * 1 + 500 * 3 * 2


def test_cost_rounds_up_and_prices_cached_tokens(prices: PriceTable) -> None:
    assert prices.cost_micros("acme-llm", Usage(1_000, 10, 400)) == 600 + 40 + 20
    assert prices.cost_micros("ACME-LLM", Usage(1, 0, 1)) == 1  # 0.1 micro rounds up to 1


def test_cache_writes_hold_every_input_token_at_the_dearest_write(prices: PriceTable) -> None:
    # Any input token may be written to a 1-hour cache ($2): 1,000 x 2 + 100 x 2.
    assert prices.worst_case_micros("m-cache", 1_000, 100) == 2_200
    # 450 plain ($1) + 400 read ($0.10) + 100 written ($1.25) + 50 written for 1 h ($2),
    # and 10 out ($2): 450 + 40 + 125 + 100 + 20.
    usage = Usage(1_000, 10, cached_input_tokens=400, cache_write_tokens=100,
                  cache_write_1h_tokens=50)
    assert prices.cost_micros("m-cache", usage) == 735


def test_audio_is_held_and_charged_at_audio_rates(prices: PriceTable) -> None:
    # 100 text tokens ($1); 1.5 s of audio at 10 tokens a second = 15 tokens ($10); 50 out at
    # the dearest output rate, audio's ($20): 100 + 150 + 1,000.
    audio = Media(audio_ms=1_500, audio_field="messages[0].content[0].input_audio")
    assert prices.worst_case_micros("m-audio", 100, 50, media=audio) == 1_250
    # 200 in, of which 50 audio and 20 cache reads; the answer does not say whether the reads
    # were text or audio, so the dearer split: 20 text reads ($0.10) and 130 text ($1) and 50
    # audio ($10) = 2 + 130 + 500 = 632 (the other split: 150 + 30 x 10 + 20 x 1 = 470).
    # 30 out, 10 of them audio: 20 x 2 + 10 x 20 = 240.
    usage = Usage(200, 30, cached_input_tokens=20, input_audio_tokens=50, output_audio_tokens=10)
    assert prices.cost_micros("m-audio", usage) == 632 + 240


def test_a_model_without_audio_rates_is_refused_audio(prices: PriceTable) -> None:
    audio = Media(audio_ms=1_000, audio_field="messages[0].content[1].input_audio")
    with pytest.raises(InputUnbounded) as unbounded:  # no audio tokenization known either
        prices.worst_case_micros("m-text", 10, 10, media=audio)
    assert unbounded.value.details["field"] == "messages[0].content[1].input_audio"
    with pytest.raises(ModelUnpriced) as unpriced:
        prices.cost_micros("m-text", Usage(100, 10, input_audio_tokens=50))
    assert unpriced.value.details["field"] == "input_audio_tokens"
    with pytest.raises(ModelUnpriced):
        prices.cost_micros("m-text", Usage(100, 10, output_audio_tokens=5))


def test_the_request_fee_is_held_and_charged_once(prices: PriceTable) -> None:
    # $0.002 a request is 2,000 micros, whatever n is.
    assert prices.worst_case_micros("m-fee", 10, 10) == 10 + 10 + 2_000
    assert prices.worst_case_micros("m-fee", 10, 10, 3) == 10 + 30 + 2_000
    assert prices.cost_micros("m-fee", Usage(5, 5)) == 5 + 5 + 2_000


def test_web_searches_are_held_at_their_fees_and_every_step_at_its_whole_context(
    tmp_path: Path,
) -> None:
    path = tmp_path / "prices.json"
    write(path, {"m-search": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                              "usd_per_web_search": "0.01", "web_search_result_tokens_max": 500}})
    table = PriceTable.from_file(str(path))
    searches = Media(web_searches=2, web_search_field="tools[1]")
    # 2 searches at $0.01 (10,000 micros each); 3 steps, each billing at most the prompt (100),
    # both searches' results (2 x 500) and the output so far (50): 3 x 1,150 at $1, and 50 out
    # at $2.
    assert table.worst_case_micros("m-search", 100, 50, media=searches) == (
        20_000 + 3_450 + 100)
    # Settled from what was billed: 2 searches, their results among the 1,100 input tokens.
    assert table.cost_micros("m-search", Usage(1_100, 50, web_search_requests=2)) == (
        20_000 + 1_100 + 100)
    # A model whose results have no stated bound: each step is held at its context window
    # (claude-sonnet-4-5 reads 200,000 tokens), 3 steps; 600,000 tokens together reach its
    # long-context rates: $12 a million for a 1-hour cache write, $22.50 for output.
    held = bundled(datetime(2026, 12, 1, 11, tzinfo=UTC)).worst_case_micros(
        "claude-sonnet-4-5", 100, 50, media=searches)
    assert held == 20_000 + 3 * 200_000 * 12 + -(-50 * 225 // 10)
    # With a stated bound too, the tighter of the two.
    write(path, {"m-search": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                              "usd_per_web_search": "0.01", "web_search_result_tokens_max": 500,
                              "context_window_tokens": 600}})
    assert PriceTable.from_file(str(path)).worst_case_micros(
        "m-search", 100, 50, media=searches) == 20_000 + 3 * 600 + 100
    # Neither: refused by the tool's field, never guessed.
    write(path, {"m-search": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                              "usd_per_web_search": "0.01"}})
    with pytest.raises(InputUnbounded) as unbounded:
        PriceTable.from_file(str(path)).worst_case_micros("m-search", 100, 50, media=searches)
    assert unbounded.value.details["field"] == "tools[1]"
    assert "context_window_tokens" in unbounded.value.message
    # A model with no fee for searches: searches it reports are unpriced, never free.
    write(path, {"m-search": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
                              "web_search_result_tokens_max": 500}})
    no_fee = PriceTable.from_file(str(path))
    with pytest.raises(ModelUnpriced):
        no_fee.worst_case_micros("m-search", 100, 50, media=searches)
    with pytest.raises(ModelUnpriced) as unpriced:
        no_fee.cost_micros("m-search", Usage(1_100, 50, web_search_requests=1))
    assert unpriced.value.details["field"] == "web_search_requests"


# Anthropic's published multipliers of a model's base input rate
# (https://platform.claude.com/docs/en/about-claude/pricing, "prompt caching"): 5-minute cache
# writes 1.25x, 1-hour writes 2x, cache reads 0.1x; and web search $10 per 1,000 searches.
ANTHROPIC_CACHE_MULTIPLIERS = {"cache_write": Decimal("1.25"), "cache_write_1h": Decimal(2),
                               "cached_input": Decimal("0.1")}
CLAUDE_MODELS = ("claude-opus-4-5", "claude-opus-4-1", "claude-opus-4", "claude-sonnet-4-5",
                 "claude-sonnet-4", "claude-haiku-4-5", "claude-3-5-haiku-20241022",
                 "claude-3-7-sonnet-20250219", "claude-sonnet-4-5-20250929")


@pytest.mark.parametrize("model", CLAUDE_MODELS)
def test_the_bundled_claude_cache_rates_are_anthropics_multipliers(model: str) -> None:
    rates = bundled(datetime(2026, 12, 1, 11, tzinfo=UTC)).rates(model)
    for kind, multiple in ANTHROPIC_CACHE_MULTIPLIERS.items():
        schedule = getattr(rates, kind)
        assert schedule is not None, (model, kind)
        # At every input size: a long-context tier keeps the same multiples of its own input.
        assert [(start, rate) for start, rate in schedule] == [
            (start, rate * multiple) for start, rate in rates.input], (model, kind)
    assert rates.web_search_micros == Decimal(10_000)  # $10 / 1,000 searches, in micros


def test_service_tiers_hold_the_requested_tier_and_auto_the_dearest(prices: PriceTable) -> None:
    # 1,000 in and 100 out: default $1/$2, priority $3/$6, flex $0.50/$1.
    worst = {tier: prices.worst_case_micros("m-tiers", 1_000, 100, service_tier=tier)
             for tier in (None, "default", "priority", "flex", "auto")}
    assert worst == {None: 1_200, "default": 1_200, "priority": 3_600, "flex": 600,
                     "auto": 3_600}
    with pytest.raises(ModelUnpriced) as unknown:
        prices.worst_case_micros("m-tiers", 1_000, 100, service_tier="scale")
    assert unknown.value.details["field"] == "service_tier"
    # A model with one set of rates knows no named tier.
    with pytest.raises(ModelUnpriced):
        prices.worst_case_micros("m-text", 1, 1, service_tier="priority")
    assert prices.worst_case_micros("m-text", 1, 1, service_tier="auto") == 2


def test_a_usage_is_charged_at_the_tier_its_answer_names(prices: PriceTable) -> None:
    charged = {tier: prices.cost_micros("m-tiers", Usage(1_000, 100, service_tier=tier))
               for tier in (None, "default", "priority", "flex", "auto")}
    # `auto`: the answer named no tier, so the dearest it could have been served at.
    assert charged == {None: 1_200, "default": 1_200, "priority": 3_600, "flex": 600,
                       "auto": 3_600}
    with pytest.raises(ModelUnpriced):
        prices.cost_micros("m-tiers", Usage(1_000, 100, service_tier="scale"))
    # A model with one set of rates is billed at them, whatever tier its provider names.
    assert prices.cost_micros("m-text", Usage(10, 10, service_tier="on_demand")) == 20


def test_images_are_held_at_the_models_per_image_bound(prices: PriceTable) -> None:
    # 50 text tokens, 2 low-detail images (100 each) and 1 high (1,000), all at $2; 10 out at $2.
    media = Media(images_low=2, images_high=1, image_field="messages[0].content[0].image_url")
    assert prices.worst_case_micros("m-image", 50, 10, media=media) == (
        (50 + 200 + 1_000) * 2 + 10 * 2)
    with pytest.raises(InputUnbounded) as unbounded:
        prices.worst_case_micros("m-text", 50, 10, media=media)
    assert unbounded.value.details["field"] == "messages[0].content[0].image_url"


def test_overrides_win_over_the_bundled_table_and_keep_its_image_rules(
    prices: PriceTable,
) -> None:
    assert prices.worst_case_micros("gpt-4o", 100, 100) == 200
    assert "+overrides." in prices.version
    # The file prices gpt-4o; OpenAI's image rule for it still holds: 85 + 170 x 8 at $1.
    assert prices.worst_case_micros("gpt-4o", 0, 1, media=Media(images_high=1)) == 1_445 + 1


# -- the bundled table ----------------------------------------------------------------------------


def bundled(at: datetime) -> PriceTable:
    return PriceTable(now_s=lambda: at.timestamp())


def test_the_bundled_table_prices_known_models_at_every_tier() -> None:
    table = bundled(datetime(2026, 12, 1, 11, tzinfo=UTC))
    # gpt-4o: $2.50 in, $10 out per million tokens; priority $4.25 / $17.
    assert table.worst_case_micros("gpt-4o", 1_000, 500, 2) == 2_500 + 10_000
    assert table.worst_case_micros("gpt-4o", 1_000, 500, 2, service_tier="priority") == (
        4_250 + 17_000)
    assert table.worst_case_micros("gpt-4o", 1_000, 500, 2, service_tier="auto") == (
        4_250 + 17_000)
    # A 1024 x 1024 image on gpt-4o is billed 765 tokens: the hold is the 1,445 any image can be.
    assert table.worst_case_micros("gpt-4o", 0, 1, media=Media(images_high=1),
                                   service_tier="default") == -(-(1_445 * 25) // 10) + 10
    assert table.version.startswith("genai-prices-")
    assert "@2026-12-01T11:00Z" in table.version


def test_the_bundled_table_holds_cache_writes_and_token_tiers() -> None:
    table = bundled(datetime(2026, 12, 1, 11, tzinfo=UTC))
    # claude-sonnet-4-5: $3 in ($6 above 200k tokens), cache writes $3.75 ($7.50), 1-hour
    # writes $6 ($12); out $15 ($22.50). A small call cannot reach the 200k tier: its input is
    # held at the 1-hour write, $6: 1,000 x 6 + 100 x 15.
    assert table.worst_case_micros("claude-sonnet-4-5", 1_000, 100) == 6_000 + 1_500
    # 300,000 input tokens can: every one at $12, and the output at $22.50.
    assert table.worst_case_micros("claude-sonnet-4-5", 300_000, 100) == 3_600_000 + 2_250


def test_audio_models_are_held_at_their_audio_rates() -> None:
    table = bundled(datetime(2026, 12, 1, 11, tzinfo=UTC))
    # gpt-audio: $2.50 text in, $32 audio in, $10 text out, $64 audio out; 10 tokens a second.
    # 10 s of audio = 100 tokens at $32; 100 text at $2.50; 10 out at $64.
    audio = Media(audio_ms=10_000, audio_field="a")
    assert table.worst_case_micros("gpt-audio", 100, 10, media=audio) == 250 + 3_200 + 640
    # gpt-4o-audio-preview has no audio rate in the bundled table: refused, never priced as text.
    with pytest.raises((ModelUnpriced, InputUnbounded)):
        table.worst_case_micros("gpt-4o-audio-preview", 100, 10, media=audio)


def test_a_price_that_starts_soon_is_held_before_it_starts() -> None:
    # genai-prices starts gpt-4o's priority rates on 2026-10-12. A window ending an hour and a
    # quarter (the window and the longest lease) before that holds priority at default rates...
    early = bundled(datetime(2026, 10, 1, 12, tzinfo=UTC))
    assert early.worst_case_micros("gpt-4o", 1_000, 100, service_tier="priority") == 2_500 + 1_000
    # ...a window whose calls can be billed on the 12th holds the new rates already.
    eve = bundled(datetime(2026, 10, 11, 23, 30, tzinfo=UTC))
    assert eve.worst_case_micros("gpt-4o", 1_000, 100, service_tier="priority") == 4_250 + 1_700


def test_time_of_day_prices_are_held_at_their_dearest() -> None:
    from genai_prices import data_snapshot

    evening = datetime(2026, 12, 1, 20, tzinfo=UTC)
    _, info = data_snapshot.get_snapshot().find_provider_model("deepseek-chat", None, None, None)
    # genai-prices itself prices an evening call at deepseek's lower rate ($0.135)...
    assert info.get_prices(evening).input_mtok == Decimal("0.135")
    # ...but a call reserved then may be billed in the dearer hours ($0.27 from 00:30).
    assert bundled(evening).rates("deepseek-chat").input == ((0, Decimal("0.27")),)


def test_an_unknown_model_is_refused_never_free() -> None:
    with pytest.raises(ModelUnpriced) as info:
        PriceTable().rates("brand-new-model-9000")
    assert info.value.code == "model_unpriced"


# -- every component held, one name one price ---------------------------------------------------


def _exact_and_family_names(clause: Any) -> list[str]:
    names = [v.lower() for v in (getattr(clause, "equals", None),
                                 getattr(clause, "starts_with", None)) if isinstance(v, str)]
    for child in getattr(clause, "or_", None) or ():
        names += _exact_and_family_names(child)
    return names


def test_every_component_of_every_bundled_price_is_held_or_the_model_refused() -> None:
    """Every entry of the bundled table a name reaches, walked through the planner, judged by
    genai-prices' own calculator: for each component the entry prices (each token kind, at each
    input size tier and service tier, fees per request, a search model's search), a usage that
    bills the whole call at that component costs no more than the worst case the gateway holds
    for a request that names no tier, or the model is refused."""
    import warnings

    from genai_prices import Usage as Billed
    from genai_prices import calc_price, data_snapshot

    snapshot = data_snapshot.get_snapshot()
    table = PriceTable(now_s=lambda: DECEMBER_S)
    when = datetime.fromtimestamp(DECEMBER_S, UTC)
    output_tokens = 1_000
    walked, refused, seen = 0, 0, set()
    for provider in snapshot.providers:
        for entry in provider.models:
            for name in [entry.id.lower(), *_exact_and_family_names(entry.match)]:
                try:
                    found, info = snapshot.find_provider_model(name, None, None, None)
                except LookupError:
                    continue
                if (found.id, info.id) in seen:
                    continue
                seen.add((found.id, info.id))
                walked += 1
                tiers = [None, *sorted({v.when["service_tier"] for v in info.price_variants or ()
                                        if set(v.when) == {"service_tier"}})]
                for input_tokens in (1_000, 300_000):  # below and above long-context tiers
                    try:
                        worst = table.worst_case_micros(name, input_tokens, output_tokens,
                                                        service_tier="auto")
                    except ModelUnpriced:
                        refused += 1
                        break
                    i, o = input_tokens, output_tokens
                    usages: list[dict[str, int]] = [
                        {"input_tokens": i, "output_tokens": o},
                        {"input_tokens": i, "cache_write_tokens": i, "output_tokens": o},
                        {"input_tokens": i, "cache_read_tokens": i, "output_tokens": o},
                        {"input_tokens": i, "cache_write_tokens": i, "cache_write_1h_tokens": i,
                         "output_tokens": o},
                        {"input_tokens": i, "output_tokens": o, "output_reasoning_tokens": o},
                    ]
                    if core.prices.SEARCH_EVERY_CALL_FAMILY.search(name):
                        usages = [{**u, "web_searches": 1} for u in usages]
                    for tier in tiers:
                        for usage in usages:
                            with warnings.catch_warnings():
                                warnings.simplefilter("ignore")
                                billed = calc_price(
                                    Billed(**usage), name, genai_request_timestamp=when,
                                    price_context={"service_tier": tier} if tier else None)
                            billed_micros = -(-billed.total_price * 1_000_000 // 1)
                            assert billed_micros <= worst, (name, tier, usage, worst)
    # The walk reached the table, and most of it is priced.
    assert walked > 400
    assert refused < walked // 4, (walked, refused)


def test_a_search_model_is_held_and_charged_its_search_on_every_call() -> None:
    # gpt-4o-mini-search-preview is gpt-4o-mini's entry in genai-prices ($0.15 in, $0.60 out
    # per million), whose web search is $10 per 1,000: 10,000 micros a call, which no usage
    # reports.
    table = PriceTable(now_s=lambda: DECEMBER_S)
    search, base = "gpt-4o-mini-search-preview", "gpt-4o-mini"
    held = table.worst_case_micros(search, 1_000, 100, service_tier="default")
    assert held == table.worst_case_micros(base, 1_000, 100, service_tier="default") + 10_000
    usage = Usage(input_tokens=1_000, output_tokens=100)
    assert table.cost_micros(search, usage) == table.cost_micros(base, usage) + 10_000
    assert table.cost_micros(search + "-2025-03-11", usage) == table.cost_micros(search, usage)


@pytest.mark.parametrize("model", ["gpt-4o-search-preview", "gpt-5-search-api"])
def test_a_search_model_whose_search_has_no_known_fee_is_refused(
        model: str, tmp_path: Path) -> None:
    with pytest.raises(ModelUnbounded) as info:
        PriceTable().worst_case_micros(model, 10, 10)
    assert info.value.code == "model_unbounded"
    assert info.value.details["component"] == "web_search"
    # A prices file that gives the fee prices it, and holds the fee on every call.
    path = tmp_path / "prices.json"
    write(path, {model: {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1",
                         "usd_per_web_search": "0.025"}})
    assert PriceTable.from_file(str(path)).worst_case_micros(model, 10, 10) == 20 + 25_000


def test_the_prices_file_names_a_model_that_searches_on_every_call(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    write(path, {"acme-search": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1",
                                 "usd_per_web_search": "0.005", "web_searches_per_call": 2},
                 "acme-nofee": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1",
                                "web_searches_per_call": 1}})
    table = PriceTable.from_file(str(path))
    assert table.worst_case_micros("acme-search", 10, 10) == 20 + 10_000
    assert table.cost_micros("acme-search", Usage(10, 10)) == 20 + 10_000
    with pytest.raises(ModelUnbounded):
        table.rates("acme-nofee")


@pytest.mark.parametrize("model", [
    "claude-haiku-4-5-20251001",  # a family's dated snapshot, as Anthropic names them
    "claude-3-5-haiku-latest",  # an entry's own id
    "gpt-4o-2024-08-06",  # a documented alias
])
def test_a_name_the_table_gives_is_priced(model: str) -> None:
    assert PriceTable(now_s=lambda: DECEMBER_S).worst_case_micros(model, 10, 10) > 0


@pytest.mark.parametrize("model", [
    "claude-sonnet-4-5-x",  # a family's prefix with another tail
    "gpt-5.2-20251211",  # a compact date genai-prices normalises
    "claude-haiku-4-5-20251001-preview",
])
def test_a_name_the_table_only_resembles_is_refused(model: str) -> None:
    with pytest.raises(ModelUnpriced) as info:
        PriceTable(now_s=lambda: DECEMBER_S).rates(model)
    assert info.value.code == "model_unpriced"


def test_tiers_charge_the_highest_rate_in_the_worst_case() -> None:
    tiers = ((0, Decimal("1")), (200_000, Decimal("2")))
    assert Rates.at(tiers, 200_000) == 1
    assert Rates.at(tiers, 200_001) == 2


# -- input checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [-1, 1.5, "10", True, 10**9])
def test_bad_token_counts_are_refused(prices: PriceTable, tokens: object) -> None:
    with pytest.raises(InvalidRequest):
        prices.worst_case_micros("acme-llm", tokens, 10)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        prices.worst_case_micros("acme-llm", 10, tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("usage", [
    {"input_tokens": 10, "output_tokens": 1, "cached_input_tokens": 8, "cache_write_tokens": 3},
    {"input_tokens": 10, "output_tokens": 1, "input_audio_tokens": 8, "cache_write_tokens": 3},
    {"input_tokens": 10, "output_tokens": 1, "output_audio_tokens": 2},
    {"input_tokens": 10, "output_tokens": 1, "service_tier": ""},
    {"input_tokens": 10, "output_tokens": 1, "service_tier": 3},
])
def test_a_usage_whose_parts_exceed_its_whole_is_refused(usage: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        Usage(**usage)


# -- the prices file ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [{"models": {"m": {"input_usd_per_mtok": 1.0}}},
     {"models": {"m": {"input_usd_per_mtok": "-1"}}},
     {"models": {"m": {"input_usd_per_mtok": "NaN"}}},
     {"models": {"m": {"input_usd_per_mtok": "1e9"}}},
     {"models": {"m": {"output_usd_per_mtok": "1"}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "typo": "1"}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "usd_per_request": "2000000"}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "service_tiers": {"auto": {}}}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "service_tiers": {"p": {"typo": "1"}}}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "service_tiers": {"p": {
         "service_tiers": {}}}}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "image_input_tokens_max": {"low": 5}}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "image_input_tokens_max": {"high": True}}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "image_input_tokens_max": {
         "high": 5, "medium": 3}}}},
     {"models": {"m": {"input_usd_per_mtok": "1", "audio_input_tokens_per_s": 0}}},
     {"models": {"m": {"input_usd_per_mtok": "1"}}, "extra": {}},
     {"models": {"": {"input_usd_per_mtok": "1"}}},
     {"models": []},
     {"modles": {}}],
)
def test_a_bad_prices_file_is_refused(tmp_path: Path, doc: object) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidRequest):
        PriceTable.from_file(str(path))


def test_the_prices_file_reads_every_field(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write(path, {"m": {
        "input_usd_per_mtok": "1", "output_usd_per_mtok": "2", "cached_input_usd_per_mtok": "0.1",
        "cache_write_usd_per_mtok": "1.25", "cache_write_1h_usd_per_mtok": "2",
        "input_audio_usd_per_mtok": "32", "cached_input_audio_usd_per_mtok": "0.4",
        "output_audio_usd_per_mtok": "64", "usd_per_request": "0.005",
        "service_tiers": {"priority": {"input_usd_per_mtok": "1.7", "usd_per_request": "0"}},
        "image_input_tokens_max": {"high": 500}, "audio_input_tokens_per_s": 25}})
    rates = load_prices_file(str(path))[0]["m"]
    one = {name: getattr(rates, name)[0][1] for name in (
        "input", "output", "cached_input", "cache_write", "cache_write_1h", "input_audio",
        "cached_input_audio", "output_audio")}
    assert one == {"input": 1, "output": 2, "cached_input": Decimal("0.1"),
                   "cache_write": Decimal("1.25"), "cache_write_1h": 2, "input_audio": 32,
                   "cached_input_audio": Decimal("0.4"), "output_audio": 64}
    assert rates.request_micros == 5_000
    assert rates.image_tokens_max == ImageBound(500, 500)  # low is high unless given
    assert rates.audio_input_tokens_per_s == 25
    priority = rates.service_tiers["priority"]
    # A tier changes what it names and keeps the model's other rates.
    assert (priority.input[0][1], priority.output, priority.request_micros) == (
        Decimal("1.7"), rates.output, 0)


# -- freshness ----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.s = 1_000.0

    def __call__(self) -> float:
        return self.s


def test_the_prices_file_is_read_again_when_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "p.json"
    write(path, {"m": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1"}})
    clock = Clock()
    table = PriceTable.from_file(str(path), monotonic_s=clock, now_s=lambda: DECEMBER_S)
    version = table.version
    assert table.worst_case_micros("m", 100, 100) == 200

    write(path, {"m": {"input_usd_per_mtok": "3", "output_usd_per_mtok": "1"}})
    os.utime(path, ns=(1, 10**18))
    clock.s += 0.5  # within the second: not looked at yet
    assert table.worst_case_micros("m", 100, 100) == 200
    clock.s += 0.6
    assert table.worst_case_micros("m", 100, 100) == 400
    assert table.version != version

    # A file that does not parse leaves the last good prices in force, and says so once.
    path.write_text("{not json")
    os.utime(path, ns=(1, 2 * 10**18))
    for _ in range(3):
        clock.s += 1.1
        assert table.worst_case_micros("m", 100, 100) == 400
    assert sum("stay in force" in r.message for r in caplog.records) == 1
    write(path, {"m": {"input_usd_per_mtok": "5", "output_usd_per_mtok": "1"}})
    os.utime(path, ns=(1, 3 * 10**18))
    clock.s += 1.1
    assert table.worst_case_micros("m", 100, 100) == 600


def test_the_lookup_path_reads_no_file_and_asks_genai_prices_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.json"
    write(path, {"m": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1"}})
    clock = Clock()
    now_s = [DECEMBER_S]
    table = PriceTable.from_file(str(path), monotonic_s=clock, now_s=lambda: now_s[0])
    stats: list[str] = []
    lookups: list[str] = []
    real_signature, real_bundled = core.prices.table._signature, core.prices.table._bundled_rates
    monkeypatch.setattr(core.prices.table, "_signature",
                        lambda p: stats.append(p) or real_signature(p))
    monkeypatch.setattr(core.prices.table, "_bundled_rates",
                        lambda m, w, p=None: lookups.append(m) or real_bundled(m, w, p))
    for _ in range(1_000):
        table.worst_case_micros("m", 10, 10)
        table.worst_case_micros("gpt-4o", 10, 10)
        with pytest.raises(ModelUnpriced):
            table.rates("brand-new-model-9000")
    # The prices file's model is looked up once too: for a context window it does not name.
    assert (stats, lookups) == ([], ["m", "gpt-4o", "brand-new-model-9000"])
    clock.s += 1.1
    table.worst_case_micros("m", 10, 10)
    assert stats == [str(path)]
    # The next hour's window resolves bundled rates again, and says so in the version.
    version = table.version
    now_s[0] += BUNDLED_WINDOW_S
    clock.s += 1.1
    table.worst_case_micros("gpt-4o", 10, 10)
    assert lookups[-1] == "gpt-4o"
    assert len(lookups) == 4
    assert table.version != version


# -- the property -------------------------------------------------------------------------------

RATE = st.decimals(min_value=0, max_value=50, places=2)
FLAT = RATE.map(lambda r: ((0, r),))
TIERS = st.one_of(
    FLAT, st.tuples(RATE, st.integers(1, 5_000), RATE).map(lambda t: ((0, t[0]), (t[1], t[2]))),
)


def rates_of(draw: st.DrawFn, tiers: bool) -> Rates:
    # Half the models have no size-dependent rate: the reserve path's shortcut.
    some = draw(st.sampled_from([FLAT, TIERS]))
    maybe = st.one_of(st.none(), some)
    return Rates(
        draw(some), draw(some), draw(maybe), draw(maybe), draw(maybe), draw(some),
        draw(maybe), draw(some), draw(RATE) * 1_000,
        service_tiers={name: rates_of(draw, False) for name in draw(st.lists(
            st.sampled_from(["priority", "flex"]), unique=True, max_size=2 if tiers else 0))},
        image_tokens_max=ImageBound(draw(st.integers(0, 2_000)), draw(st.integers(0, 2_000))),
        audio_input_tokens_per_s=draw(st.integers(1, 40)),
        web_search_micros=draw(RATE) * 1_000,
        web_search_result_tokens_max=draw(st.integers(1, 5_000)),
    )


def up_to(most: int) -> st.SearchStrategy[int]:
    """Any count to `most`, and `most` itself often: a bill at its bound is the one to check."""
    return st.one_of(st.just(most), st.integers(0, most))


def split(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    cuts = sorted(draw(st.integers(0, total)) for _ in range(parts))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_no_usage_a_request_can_produce_costs_more_than_its_worst_case(data: st.DataObject) -> None:
    draw = data.draw
    rates = rates_of(draw, tiers=True)
    table = PriceTable({"m": rates})
    text = draw(st.integers(0, 10_000))
    low, high, audio_ms = draw(st.one_of(st.just((0, 0, 0)), st.tuples(
        st.integers(0, 3), st.integers(0, 3), st.integers(0, 60_000))))
    cap, choices = draw(st.integers(1, 5_000)), draw(st.integers(1, 4))
    tier = draw(st.sampled_from([None, "default", "auto", *rates.service_tiers]))
    searches = draw(st.sampled_from([0, 0, 1, 3]))
    media = (Media(low, high, audio_ms, web_searches=searches)
             if low or high or audio_ms or searches else NO_MEDIA)
    worst = table.worst_case_micros("m", text, cap, choices, service_tier=tier, media=media)

    # Any usage within the bounds: text billed at most its byte bound, each image at most its
    # detail's bound, audio at most its duration's tokens; any of it read from or written to a
    # cache; output up to the cap for each choice, any of it audio; served at any tier the
    # request may be served at, named or not. With web searches, up to their number, each step
    # of the call (one more than the searches) billing the prompt, every search's results at
    # their bound and the output so far.
    assert rates.image_tokens_max is not None
    assert rates.audio_input_tokens_per_s is not None
    assert rates.web_search_result_tokens_max is not None
    image_max = low * rates.image_tokens_max.low_tokens + high * rates.image_tokens_max.high_tokens
    steps = searches + 1
    step_max = (text + image_max + searches * rates.web_search_result_tokens_max
                + cap * choices if searches else text + image_max)
    text_in = draw(up_to(steps * step_max))
    audio_in = draw(up_to(steps * -(-audio_ms * rates.audio_input_tokens_per_s // 1_000)))
    plain, writes, writes_1h = split(draw, text_in, 2)
    reads = draw(up_to(plain + audio_in))
    output = draw(up_to(cap * choices))
    served = {None: [None, "default"], "default": [None, "default"],
              "auto": [None, "auto", *rates.service_tiers]}.get(tier, [tier])
    usage = Usage(text_in + audio_in, output, reads, writes, writes_1h, audio_in,
                  draw(st.integers(0, output)), draw(st.sampled_from(served)),
                  draw(up_to(searches)))
    assert table.cost_micros("m", usage) <= worst


@settings(max_examples=examples(100), deadline=None)
@given(TIERS, TIERS, st.integers(0, 10_000))
def test_merged_tiers_are_as_dear_as_each_at_every_size(a: Tiers, b: Tiers, tokens: int) -> None:
    merged = max_tiers(a, b)
    assert merged is not None
    assert Rates.at(merged, tokens) == max(Rates.at(a, tokens), Rates.at(b, tokens))


def test_a_model_is_priced_by_the_provider_that_bills_it_where_that_provider_names_it() -> None:
    """genai-prices prices claude-haiku-5-5 at $0.10 in at Anthropic and $0.025 at a reseller:
    a call is held at the prices of the provider it goes to (the gateway's upstream), and a
    provider that does not name the model leaves the first entry that does."""
    table = bundled(datetime(2026, 12, 1, 11, tzinfo=UTC))
    assert table.rates("claude-haiku-5-5", "anthropic").input[0][1] == Decimal("0.1")
    assert table.rates("claude-haiku-5-5", "quicksilverpro").input[0][1] == Decimal("0.025")
    assert table.rates("claude-haiku-5-5").input[0][1] == Decimal("0.1")
    assert table.rates("gpt-4o", "anthropic") == table.rates("gpt-4o", "openai")
    assert table.worst_case_micros("claude-haiku-5-5", 1_000_000, 1, provider="anthropic") > (
        table.worst_case_micros("claude-haiku-5-5", 1_000_000, 1, provider="quicksilverpro"))
