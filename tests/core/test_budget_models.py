"""A budget's models (core/budgets.py ModelLimits, canonical_models): every name a budget gives
a model is the priced model's one name, so that a dated, aliased or differently spelt name of
one model is one entry and one counter; a name no price table knows is refused naming its field,
and nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from core.budget_json import budget_json, definition_of_json
from core.budgets import (
    RESERVED_SCOPE_KINDS,
    BudgetDef,
    BudgetId,
    Limit,
    ModelLimits,
    Period,
    canonical_models,
)
from core.errors import InvalidRequest
from core.limits import MODELS_ALLOW_MAX, PER_MODEL_MAX
from core.prices import PriceTable
from core.service import CallSpec, CeilingService
from core.stores import wire
from core.stores.memory import MemoryStore
from core.stores.scripted_catalogue import definition_fields, definition_of

BID = BudgetId("org:acme/team:a")
DAY = [{"period": "day", "ceiling_micros": 1_000}]
PRICES = PriceTable()


def put_body(**fields: Any) -> BudgetDef:
    return definition_of_json(BID, {"limits": DAY, **fields})


def canonical(**fields: Any) -> BudgetDef:
    return canonical_models(put_body(**fields), PRICES.model_name)


@pytest.mark.parametrize(("given", "one_name"), [
    ("gpt-5", "gpt-5"),
    ("gpt-5-2025-08-07", "gpt-5"),  # a dated snapshot
    ("GPT-5", "gpt-5"),  # the table looks names up in lower case
    ("gpt-5-chat-latest", "gpt-5"),  # an alias genai-prices gives the same entry
    ("claude-haiku-4-5-20251001", "claude-haiku-4-5"),
    ("claude-sonnet-4-5@20250929", "claude-sonnet-4-5"),  # Vertex's dated spelling
])
def test_every_name_of_a_model_is_its_one_name(given: str, one_name: str) -> None:
    assert PRICES.model_name(given) == one_name
    found = canonical(models={"allow": [given]},
                      per_model={given: {"limits": DAY}})
    assert found.models_allow == (one_name,)
    assert found.per_model == (ModelLimits(one_name, (Limit(Period.DAY, 1_000),)),)


def test_two_names_of_one_model_are_one_entry_of_an_allow_list() -> None:
    found = canonical(models={"allow": ["gpt-5-2025-08-07", "gpt-5", "claude-haiku-4-5"]})
    assert found.models_allow == ("claude-haiku-4-5", "gpt-5")


def test_two_names_of_one_model_in_per_model_are_refused() -> None:
    """Each would be a counter of its own: a key would spend up to both limits on one model."""
    with pytest.raises(InvalidRequest) as refused:
        canonical(per_model={"gpt-5": {"limits": DAY}, "gpt-5-2025-08-07": {"limits": DAY}})
    assert refused.value.details["field"] == "per_model.gpt-5-2025-08-07"


@pytest.mark.parametrize(("fields", "field"), [
    ({"models": {"allow": ["gpt-5", "gpt-5x"]}}, "models.allow[1]"),
    ({"models": {"allow": ["gpt-5-2025-08-07-extra"]}}, "models.allow[0]"),
    ({"per_model": {"no-such-model": {"limits": DAY}}}, "per_model.no-such-model"),
    ({"per_model": {"us.anthropic.claude-haiku-4-5-20251001-v1:0": {"limits": DAY}}},
     "per_model.us.anthropic.claude-haiku-4-5-20251001-v1:0"),
])
def test_a_name_no_price_table_knows_is_refused_naming_its_field(
        fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        canonical(**fields)
    assert refused.value.details["field"] == field


@pytest.mark.parametrize(("body", "field"), [
    ({"models": {"allow": []}}, "models.allow"),
    ({"models": {"allow": "gpt-5"}}, "models.allow"),
    ({"models": {"allow": [5]}}, "models.allow[0]"),
    ({"models": {"deny": ["gpt-5"]}}, "models"),
    ({"models": {"allow": [f"m{i}" for i in range(MODELS_ALLOW_MAX + 1)]}}, "models.allow"),
    ({"per_model": ["gpt-5"]}, "per_model"),
    ({"per_model": {"gpt-5": {"limits": []}}}, "per_model.gpt-5.limits"),
    ({"per_model": {"gpt-5": {"limits": DAY, "users_max": 3}}}, "per_model.gpt-5"),
    ({"per_model": {f"m{i}": {"limits": DAY} for i in range(PER_MODEL_MAX + 1)}}, "per_model"),
])
def test_a_malformed_models_setting_is_refused_naming_its_field(
        body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        put_body(**body)
    assert refused.value.details["field"] == field


def test_model_is_a_reserved_scope_kind() -> None:
    assert "model" in RESERVED_SCOPE_KINDS
    with pytest.raises(InvalidRequest) as refused:
        BudgetId.operator("org:acme/model:gpt-5")
    assert refused.value.details["field"] == "budget_id"
    assert BID.model("gpt-5").path == "org:acme/team:a/model:gpt-5"


def test_what_get_shows_reads_back_as_the_same_definition() -> None:
    found = canonical(models={"allow": ["gpt-5", "claude-haiku-4-5"]},
                      per_model={"gpt-5": {"limits": [*DAY, {"period": "total",
                                                               "ceiling_micros": 9}]}})
    assert definition_of_json(BID, budget_json(found), kept=True) == found
    # and as the ledger keeps it (a restore writes definition_fields, get_budget reads it back)
    stored = {**definition_fields(found), "alert_thresholds_pct": "50 80 100"}
    assert definition_of(BID.path, stored) == found
    assert stored["rate"] == "0 0 " + wire.MODELS_FLAG


def test_a_budget_without_models_keeps_no_models_flag() -> None:
    assert "rate" not in definition_fields(put_body())
    assert budget_json(put_body())["models"] is None
    assert budget_json(put_body())["per_model"] is None


async def test_a_put_with_a_model_no_table_knows_writes_nothing() -> None:
    store = MemoryStore()
    service = CeilingService(store, PRICES)
    with pytest.raises(InvalidRequest):
        await service.put_budget(put_body(per_model={"gpt-5": {"limits": DAY},
                                                     "nope-model": {"limits": DAY}}))
    assert await store.get_budget(BID) is None
    put = await service.put_budget(put_body(per_model={"GPT-5-2025-08-07": {"limits": DAY}}))
    assert await store.get_budget(BID) == put
    assert put.per_model[0].model == "gpt-5"


class Clock:
    def __init__(self) -> None:
        self.s = 1_000.0

    def __call__(self) -> float:
        return self.s


def _write_prices(path: Path, models: list[str], mtime_s: int) -> None:
    path.write_text(json.dumps({"models": {
        m: {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1"} for m in models}}))
    os.utime(path, ns=(1, mtime_s * 10**9))


async def test_a_model_the_prices_file_adds_can_be_named_once_it_is_read_again(
        tmp_path: Path) -> None:
    """A name no table knew is refused; once the prices file names it and is read again, a
    budget can name it: no answer of the file read before is remembered past it."""
    path = tmp_path / "prices.json"
    _write_prices(path, ["acme-1"], 1)
    clock = Clock()
    prices = PriceTable.from_file(str(path), monotonic_s=clock)
    service = CeilingService(MemoryStore(), prices)
    with pytest.raises(InvalidRequest):
        await service.put_budget(put_body(per_model={"acme-2": {"limits": DAY}}))
    _write_prices(path, ["acme-1", "acme-2"], 2)
    clock.s += 2
    prices.refresh()
    put = await service.put_budget(put_body(per_model={"acme-2": {"limits": DAY}}))
    assert put.per_model[0].model == "acme-2"


def test_a_calls_model_name_is_looked_up_again_after_the_prices_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's names follow the prices file's version, and a name in another case is the
    same entry of its cache, so callers cannot fill it with case variants."""
    path = tmp_path / "prices.json"
    _write_prices(path, ["acme-1"], 1)
    clock = Clock()
    prices = PriceTable.from_file(str(path), monotonic_s=clock)
    service = CeilingService(MemoryStore(), prices)
    looked_up: list[str] = []
    model_name = prices.model_name

    def counted(model: str, provider: str | None = None) -> str | None:
        looked_up.append(model)
        return model_name(model, provider)

    monkeypatch.setattr(prices, "model_name", counted)
    variants = ["acme-1", "ACME-1", "Acme-1", "aCme-1", "acME-1"]
    assert {service._canonical_model(CallSpec(model=m), m) for m in variants} == {"acme-1"}
    assert len(looked_up) == 1
    _write_prices(path, ["acme-1", "acme-2"], 2)
    clock.s += 2
    prices.refresh()
    assert service._canonical_model(CallSpec(model="acme-1"), "acme-1") == "acme-1"
    assert len(looked_up) == 2, "a name of the prices file read before was not looked up again"


def test_a_models_one_name_has_one_length_limit_in_python_and_lua() -> None:
    """The ledger's check (lua/lib.lua check_model) takes its limit from the one constant the
    Python check uses, and a definition takes the longer names the price table looks up."""
    from core.budgets import is_model_name
    from core.limits import MODEL_NAME_LEN_MAX, MODEL_ONE_NAME_LEN_MAX
    from core.prices import rates

    assert MODEL_NAME_LEN_MAX > MODEL_ONE_NAME_LEN_MAX
    assert not hasattr(rates, "MODEL_NAME_LEN_MAX"), "one home: core/limits.py"
    assert wire.CONSTANTS["MODEL_ONE_NAME_LEN_MAX"] == MODEL_ONE_NAME_LEN_MAX
    assert is_model_name("a" * MODEL_ONE_NAME_LEN_MAX, limited=True)
    assert not is_model_name("a" * (MODEL_ONE_NAME_LEN_MAX + 1), limited=False)
    lua = Path("lua/lib.lua").read_text()
    check = lua[lua.index("local function check_model"):]
    check = check[:check.index("\nend\n")]
    assert "MODEL_ONE_NAME_LEN_MAX" in check
    assert str(MODEL_ONE_NAME_LEN_MAX) not in check
