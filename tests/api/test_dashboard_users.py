"""The spend page's top end users: ranked as the ledger counts them, bounded, and counted once
(a user's spend is part of its budget's, which the headline already holds)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from api.routes.dashboard import render
from core import spend as spend_report
from core.budgets import BudgetDef, BudgetId, Limit, Period, PerUser
from core.ledger import LegStatus, Probe, ReservationRef, UserSpend
from core.stores.memory import MemoryStore
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for
from tests.api.test_dashboard import HEADLINE
from tests.api.test_users_admin import as_user, listing, put_budget, spend
from tests.core.stores.test_conformance import OWNER
from tests.core.stores.test_users_rates import held
from tests.support import ManualClock

# A row of the top-users table: its user, then its committed cell's exact amount.
USER_ROW = re.compile(r"<tr data-budget='([^']*)' data-user='([^']*)'[^>]*>.*?"
                      r"data-field='committed_micros' data-micros='(\d+)'")
TABLE = re.compile(r"<table class=list id=top-users>.*?</table>", re.DOTALL)


@pytest.fixture(scope="module")
def own_ledger() -> Iterator[Client]:
    """An instance on a ledger of its own: the headline adds every budget on the page, and the
    page reads a bounded number of users, so no other test's may be on it."""
    with RedisServer() as server, ServiceProcess(
            {"REDIS_URL": server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
             "CEILING_ACCEPT_NOT_DURABLE": "1"}) as s, \
            client_for(s) as c:
        yield c


def test_the_page_ranks_users_and_counts_their_spend_once(own_ledger: Client) -> None:
    http = own_ledger
    org = f"org:p{uuid.uuid4().hex[:8]}"
    put_budget(http, org)
    put_budget(http, f"{org}/team:t", None)
    key = http.sidecar_key(org)
    by_user = {"u1": 300_000, "u2": 500_000, "u3": 100_000}
    for user, micros in by_user.items():
        spend(http, as_user(key, user), micros)
    spend(http, key, 200_000)  # no user named
    spend(http, http.sidecar_key(f"{org}/team:t"), 50_000)  # a team's call, no user named

    page = http.admin("GET", "/dashboard")
    assert page.status_code == 200
    [table] = TABLE.findall(page.text)
    rows = USER_ROW.findall(table)
    assert rows == [(org, u, str(m)) for u, m in sorted(by_user.items(), key=lambda x: -x[1])]
    # As the users listing reads each (its day's window: the shortest per_user period).
    listed = {u["user"]: u["budgets"][0] for u in listing(http, org)["users"]}
    assert {u: int(m) for _, u, m in rows} == {
        u: leg["committed_micros"] for u, leg in listed.items()}
    assert {leg["period"] for leg in listed.values()} == {"day"}
    # The budget's spend holds its users' and the calls that named none; the headline counts
    # the budget once, never its users again.
    budget_total = sum(by_user.values()) + 200_000 + 50_000
    assert http.admin("GET", f"/v1/admin/budgets/{org}").json()["periods"][0][
        "committed_micros"] == budget_total
    assert f"id=spent data-micros='{budget_total}'" in page.text
    assert HEADLINE.findall(page.text)[0] == "$1.15"


def _user(budget: str, user: str, committed_micros: int) -> UserSpend:
    day = LegStatus(f"{budget}/user:{user}", "day:2026-03-14", 1_000, committed_micros, 0, 0,
                    1, 0)
    return UserSpend(user, day.budget_id, (day,))


def test_the_table_says_what_it_did_not_read_and_escapes_what_it_shows() -> None:
    found = (spend_report.BudgetUsers("org:a", Period.DAY, (_user("org:a", "u<1>", 5),), 7, 3),
             spend_report.BudgetUsers("org:b", Period.DAY, (), None, 0),
             spend_report.BudgetUsers("org:c", Period.DAY, (), 2, 2))
    view = spend_report.Overview(0, 24, (), (), (), Probe("redis", True, True, 0.1, "id", True,
                                                         (), 1), None, found)
    [table] = TABLE.findall(render(view))
    assert "u<1>" not in table
    assert "data-user='u&lt;1&gt;'" in table
    assert "data-unread='4'" in table  # 7 users, 3 read
    assert "org:b: its users were not read" in table
    assert "no end user has spent in this day yet" in table
    assert table.count("class=more") == 2  # org:c's two were both read
    empty = spend_report.Overview(0, 24, (), (), (), view.probe)
    assert "No budget holds its end users" in render(empty)


async def test_top_users_read_a_bounded_number_and_rank_the_spenders(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore(clock=ManualClock())
    await store.open()
    per_user = PerUser((Limit(Period.TOTAL, 10**6), Limit(Period.WEEK, 10**6)))
    budgets = []
    for name in ("org:a", "org:b", "org:c"):
        definition = BudgetDef(BudgetId(name), (Limit(Period.TOTAL, 10**9),), per_user=per_user)
        await store.put_budget(definition)
        budgets.append(spend_report.BudgetReport(name, definition, (), ()))
    plain = BudgetDef(BudgetId("org:plain"), (Limit(Period.TOTAL, 10**9),))
    await store.put_budget(plain)
    budgets.insert(1, spend_report.BudgetReport("org:plain", plain, (), ()))

    async def charge(budget: str, user: str, micros: int) -> None:
        r = await store.reserve(held(budget, budget, micros, user))
        await store.settle(ReservationRef(budget, r.reservation_id, OWNER), micros)

    for i in range(14):
        await charge("org:a", f"user-{i:02d}", 10 + i)
    # held, nothing committed: a pending place, not counted until charged
    await store.reserve(held("org:a", "org:a", 99, "user-zz"))
    await charge("org:b", "solo", 5)
    await charge("org:c", "late", 5)
    monkeypatch.setattr(spend_report, "USERS_EXAMINED_PER_BUDGET_MAX", 12)
    monkeypatch.setattr(spend_report, "USERS_EXAMINED_PAGE_MAX", 13)
    found = await spend_report.top_users(store, budgets)
    a, b, c = found
    assert [x.budget_id for x in found] == ["org:a", "org:b", "org:c"]  # org:plain has no users
    assert a.period is Period.WEEK  # the shortest period its per_user limits have
    # The first 12 by id were read; of them the top ten by committed spend.
    assert (a.users_count, a.examined) == (14, 12)
    assert [u.user for u in a.top] == [f"user-{i:02d}" for i in range(11, 1, -1)]
    assert (b.users_count, b.examined, [u.user for u in b.top]) == (1, 1, ["solo"])
    assert (c.users_count, c.examined, c.top) == (None, 0, ())  # the page's reads were spent
    await store.close()
