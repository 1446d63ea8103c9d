from datetime import UTC, datetime

import pytest

from core.budgets import BudgetDef, BudgetId, Limit, Period, window_at, windows_around
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
                    "month:2025-12", "month:2026-01", "month:2026-02"]
