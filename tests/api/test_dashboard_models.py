"""The spend page's models of a budget: its allow-list, and each model of its per_model limits with
its spend in its current windows, as the ledger holds them (the admin API's read of the same
budget), escaped; a budget without models shows none."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from api.routes.dashboard import render
from core import spend as spend_report
from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, Period
from core.ledger import LegStatus, Probe
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for

GPT = "gpt-4o"
HAIKU = "claude-haiku-4-5"
SPENT_MICROS = 4_321
# A row of a card's per-model table, and one of its cells' exact amount.
MODEL_ROW = re.compile(r"<tr data-model='([^']*)' data-period='([^']*)' data-window='([^']*)'>"
                       r"(.*?)</tr>", re.DOTALL)
CELL = re.compile(r"data-field='(\w+)' data-micros='(\d+)'")


@pytest.fixture(scope="module")
def own_ledger() -> Iterator[Client]:
    """An instance on a ledger of its own: the page lists a bounded number of budgets, so no
    other test's may crowd this one's out."""
    with RedisServer() as server, ServiceProcess(
            {"REDIS_URL": server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
             "CEILING_ACCEPT_NOT_DURABLE": "1"}) as s, \
            client_for(s) as c:
        yield c


def card_of(page: str, budget_id: str) -> str:
    start = page.index(f"<section class=card data-budget='{budget_id}'>")
    return page[start:page.index("</section>", start)]


def test_the_page_shows_a_budgets_models_as_the_ledger_holds_them(own_ledger: Client) -> None:
    http = own_ledger
    tag = f"org:v{uuid.uuid4().hex[:8]}"
    r = http.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "day", "ceiling_micros": 10_000_000}],
        "models": {"allow": [HAIKU, GPT]},
        "per_model": {GPT: {"limits": [{"period": "day", "ceiling_micros": 2_000_000},
                                       {"period": "total", "ceiling_micros": 3_000_000}]}}})
    assert r.status_code == 200, r.text
    plain = f"{tag}/team:plain"
    http.admin("PUT", f"/v1/admin/budgets/{plain}", json={
        "limits": [{"period": "day", "ceiling_micros": 1_000}]}).raise_for_status()
    key = http.sidecar_key(tag)
    held = http.post("/v1/reservations", headers=key, json={
        "model": GPT, "input_tokens": 10, "max_output_tokens": 10})
    assert held.status_code == 201, held.text
    http.post(f"/v1/reservations/{held.json()['reservation_id']}/settle", headers=key,
              json={"actual_micros": SPENT_MICROS}).raise_for_status()
    open_hold = http.post("/v1/reservations", headers=key, json={
        "model": GPT, "input_tokens": 10, "max_output_tokens": 10})
    assert open_hold.status_code == 201, open_hold.text

    page = http.admin("GET", "/dashboard")
    assert page.status_code == 200
    card = card_of(page.text, tag)
    assert f"data-models-allow='{HAIKU} {GPT}'" in card
    ledger = http.admin("GET", f"/v1/admin/budgets/{tag}").json()["per_model_periods"][GPT]
    rows = {(m, p, w): dict(CELL.findall(cells)) for m, p, w, cells in MODEL_ROW.findall(card)}
    assert rows == {
        (GPT, p["period"], p["period_key"]): {
            field: str(p[field]) for field in ("ceiling_micros", "committed_micros",
                                               "reserved_micros", "remaining_micros")}
        for p in ledger}
    assert {p["committed_micros"] for p in ledger} == {SPENT_MICROS}
    assert {p["reserved_micros"] for p in ledger} == {open_hold.json()["reserved_micros"]}
    assert "class=models" not in card_of(page.text, plain)


def test_model_names_are_escaped_and_a_budget_without_a_list_takes_any() -> None:
    bid = BudgetId("org:e")
    hostile = "x<script>'"
    definition = BudgetDef(bid, (Limit(Period.DAY, 10),),
                           per_model=(ModelLimits("gpt-4o", (Limit(Period.DAY, 5),)),))
    leg = LegStatus(f"{bid.path}/model:{hostile}", "day:2026-12-05", 5, 2, 1, 0, None, 0)
    report = spend_report.BudgetReport(bid.path, definition, (), (),
                                       (spend_report.ModelSpend(hostile, (leg,)),))
    view = spend_report.Overview(0, 24, (report,), (), (),
                                 Probe("redis", True, True, 0.1, "id", True, (), 1))
    card = card_of(render(view), bid.path)
    assert "<script>" not in card
    assert "data-model='x&lt;script&gt;&#x27;'" in card
    assert "data-models-allow='*'" in card
    assert "models: any" in card
    assert "data-field='remaining_micros' data-micros='2'" in card
