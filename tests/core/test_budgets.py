from datetime import UTC, datetime

import pytest

from core.budgets import (
    RESERVED_SCOPE_KINDS,
    RUN_SCOPE_KIND,
    BudgetDef,
    BudgetId,
    Limit,
    Period,
    window_at,
    windows_around,
)
from core.errors import InvalidRequest


def ms(*args: int) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)


def test_a_path_checks_itself_and_every_ancestor() -> None:
    bid = BudgetId.parse("org:acme/team:search/key:k1")
    assert [b.path for b in bid.lineage] == ["org:acme", "org:acme/team:search", bid.path]
    assert bid.tag == "org:acme"
    assert bid.run("r-1").path == "org:acme/team:search/key:k1/run:r-1"


@pytest.mark.parametrize(
    "bad",
    ["", "acme", "org:", "org:a{b}", "org:a}", "org:a b", "org:a|b", "org:é", "org:a//team:b",
     "org:a/", "/org:a", "Org:a", "org:" + "a" * 65, "/".join(["s:x"] * 9), 7, None],
)
def test_ids_that_could_break_a_key_or_hash_tag_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        BudgetId.parse(bad)


@pytest.mark.parametrize("reserved", [
    "org:x/run:batch", "org:x/user:u1", "run:batch", "user:u1", "org:x/run:batch/team:t",
    "org:x/team:t/user:u1/key:k", "/".join(["s:x"] * 7 + ["run:r"]),
])
def test_an_operator_cannot_name_a_reserved_scope_kind_at_any_depth(reserved: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        BudgetId.operator(reserved)
    kind = next(k for k in RESERVED_SCOPE_KINDS if f"{k}:" in reserved)
    assert refused.value.details["field"] == "budget_id"
    assert f"reserved kind {kind!r}" in refused.value.message
    assert RESERVED_SCOPE_KINDS[kind] in refused.value.message
    # What the ledger wrote itself still reads back (listings, the spend page, a restore).
    assert BudgetId.parse(reserved).path == reserved


@pytest.mark.parametrize("ordinary", [
    "org:x", "org:x/team:batch", "org:run/team:user", "org:x/runs:r", "org:x/users:u",
    "org:x/team:t/key:run", "org:x/xrun:r", "org:x/run-1:r",
])
def test_an_operator_names_ordinary_ids_as_parse_does(ordinary: str) -> None:
    assert BudgetId.operator(ordinary) == BudgetId.parse(ordinary)


@pytest.mark.parametrize("bad", ["", "org:a{b}", "org:a/", "/".join(["s:x"] * 9), None])
def test_an_operator_id_is_held_to_parse_rules_first(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        BudgetId.operator(bad)


def test_the_ledger_still_names_a_key_run_under_the_reserved_kind() -> None:
    assert RUN_SCOPE_KIND in RESERVED_SCOPE_KINDS
    assert "user" in RESERVED_SCOPE_KINDS
    run = BudgetId.operator("org:x/team:t").run("batch")
    assert run.path == "org:x/team:t/run:batch"
    assert [b.path for b in run.lineage] == ["org:x", "org:x/team:t", run.path]


def test_a_budget_needs_valid_limits() -> None:
    bid = BudgetId("org:a")
    with pytest.raises(InvalidRequest):
        BudgetDef(bid, ())
    with pytest.raises(InvalidRequest):
        BudgetDef(bid, (Limit(Period.DAY, 1), Limit(Period.DAY, 2)))
    with pytest.raises(InvalidRequest):
        BudgetDef(bid, (Limit(Period.DAY, -1),))
    with pytest.raises(InvalidRequest):
        BudgetDef(bid, (Limit(Period.DAY, 1),), timezone="Mars/Olympus")
    with pytest.raises(InvalidRequest):
        BudgetDef(bid, (Limit(Period.DAY, 1.5),))  # type: ignore[arg-type]


def test_windows_follow_the_calendar_of_the_zone() -> None:
    # 2026-03-08 is the US switch to daylight time: that day in New York has 23 hours.
    w = window_at("America/New_York", Period.DAY, ms(2026, 3, 8, 12))
    assert w is not None
    assert (w.key, w.resets_at_ms - w.start_ms) == ("day:2026-03-08", 23 * 3_600_000)
    m = window_at("UTC", Period.MONTH, ms(2026, 12, 31, 23, 59))
    assert m is not None
    assert (m.key, m.resets_at_ms) == ("month:2026-12", ms(2027, 1, 1))
    assert window_at("UTC", Period.TOTAL, 0) is None


def test_windows_around_cover_a_day_either_side() -> None:
    keys = [w.key for w in windows_around("UTC", ms(2026, 1, 1, 0, 0))]
    assert keys == ["day:2025-12-31", "day:2026-01-01", "day:2026-01-02",
                    "week:2025-W52", "week:2026-W01", "week:2026-W02",
                    "month:2025-12", "month:2026-01", "month:2026-02"]
