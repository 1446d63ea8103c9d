"""A budget's JSON (core/budget_json.py): what GET shows reads back as the same definition, and
what PUT must not take is refused naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from core.alerts import AlertConfig, VelocityAlarm
from core.budget_json import budget_json, definition_of_json
from core.budgets import (
    BudgetDef,
    BudgetId,
    Limit,
    ModelLimits,
    OutagePolicy,
    Period,
    PerUser,
    Rate,
)
from core.errors import InvalidRequest

BID = BudgetId("org:acme/team:a")
DEFINITIONS = [
    BudgetDef(BID, (Limit(Period.DAY, 10**6),)),
    BudgetDef(BID, (Limit(Period.WEEK, 2_000), Limit(Period.MONTH, 5_000)), "Europe/Berlin", 500,
              OutagePolicy.ALLOWANCE, AlertConfig((25, 90), VelocityAlarm(600, 10**6, 2_500, True)),
              1_700_000_000_000, Rate(60, None),
              PerUser((Limit(Period.TOTAL, 50),), 7, True, Rate(None, 2)), clamp=True),
    BudgetDef(BID, (Limit(Period.TOTAL, 9_000),), outage_policy=OutagePolicy.OPEN,
              alerts=AlertConfig((100,), VelocityAlarm(300, 0, 1_500, False))),
    BudgetDef(BID, (Limit(Period.DAY, 10**6),), rate=Rate(None, 3),
              models_allow=("claude-haiku-4-5", "gpt-5"),
              per_model=(ModelLimits("claude-haiku-4-5", (Limit(Period.TOTAL, 7),)),
                         ModelLimits("gpt-5", (Limit(Period.DAY, 5), Limit(Period.WEEK, 6))))),
    BudgetDef(BID, (Limit(Period.DAY, 10**6),),
              per_model=(ModelLimits("gpt-5", (Limit(Period.MONTH, 5),)),)),
]


@pytest.mark.parametrize("definition", DEFINITIONS)
def test_what_get_shows_reads_back_as_the_same_definition(definition: BudgetDef) -> None:
    assert definition_of_json(BID, budget_json(definition), kept=True) == definition


def test_a_put_body_gives_the_defaults_for_what_it_leaves_out() -> None:
    found = definition_of_json(BID, {"limits": [{"period": "day", "ceiling_micros": 5}],
                                     "rate": None})
    assert found == BudgetDef(BID, (Limit(Period.DAY, 5),))
    assert found.paused_at_ms is None


@pytest.mark.parametrize(("body", "field"), [
    ({"limits": "day"}, "limits"),
    ({"limits": [{"period": "hour", "ceiling_micros": 5}]}, "limits"),
    ({"limits": [{"period": "day", "ceiling_micros": "5"}]}, "ceiling_micros"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}], "timezone": 1}, "timezone"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}], "clamp": 1}, "clamp"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}], "paused_at_ms": 1}, "budget"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}], "budget_id": "org:acme"}, "budget"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}], "outage_policy": "maybe"},
     "outage_policy"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}],
      "alerts": {"velocity": {"max_rate_multiple": "2"}}}, "alerts.velocity.max_rate_multiple"),
    ({"limits": [{"period": "day", "ceiling_micros": 5}], "per_user": {"limits": [],
                                                                       "users_max": 3}},
     "per_user.limits"),
])
def test_a_body_put_must_not_take_is_refused_naming_its_field(body: dict[str, Any],
                                                              field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        definition_of_json(BID, body)
    assert refused.value.details.get("field") == field


def test_an_export_names_the_budget_it_holds() -> None:
    shown = budget_json(DEFINITIONS[0])
    with pytest.raises(InvalidRequest):
        definition_of_json(BudgetId("org:acme/team:b"), shown, kept=True)
