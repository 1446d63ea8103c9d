"""GET /metrics end to end: a service instance as its own process, scraped as Prometheus would,
and the scrape parsed with prometheus_client's own parser.

The budget gauges are judged against the admin API's reads of the same budgets (the ledger's
committed spend, not a counter of this instance's), the bound on budgets shown against spends
made to rank them, and the refusals against refusals made. A Redis of this module's own: the
scrape shows the whole ledger, and the ranking is exact only over budgets this module made.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for

METRICS_TOKEN = "metrics-secret-for-tests"
BUDGETS_MAX = 3
# Five budgets spending different amounts: the scrape shows the three that spent most.
SPENDS = (500, 100, 400, 200, 300)
FAMILIES = {"spend_ceiling_budget_ceiling_micros", "spend_ceiling_budget_committed_micros",
            "spend_ceiling_budget_reserved_micros", "spend_ceiling_refusals",
            "spend_ceiling_ledger_up", "spend_ceiling_ledger_latency_seconds",
            "spend_ceiling_budget_model_ceiling_micros",
            "spend_ceiling_budget_model_committed_micros",
            "spend_ceiling_budget_model_reserved_micros"}


@pytest.fixture(scope="module")
def ledger_redis() -> Iterator[RedisServer]:
    with RedisServer(durable=True) as server:
        yield server


@pytest.fixture(scope="module")
def http(ledger_redis: RedisServer) -> Iterator[Client]:
    with ServiceProcess({"REDIS_URL": ledger_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
                         "CEILING_METRICS_TOKEN": METRICS_TOKEN,
                         "CEILING_METRICS_BUDGETS_MAX": str(BUDGETS_MAX)}) as s, \
            client_for(s) as c:
        yield c


def spend(http: Client, key: dict[str, str], micros: int) -> httpx.Response:
    r = http.post("/v1/reservations", headers=key, json={"amount_micros": micros})
    if r.status_code != 201:
        return r
    settled = http.post(f"/v1/reservations/{r.json()['reservation_id']}/settle", headers=key,
                        json={"actual_micros": micros})
    assert settled.status_code == 200, settled.text
    return settled


@pytest.fixture(scope="module")
def budgets(http: Client) -> list[str]:
    """Five budgets (the largest spender with two periods), each spent, and one refusal."""
    made = []
    for i, micros in enumerate(SPENDS):
        budget_id = f"org:m{uuid.uuid4().hex[:8]}"
        limits = [{"period": "total", "ceiling_micros": 1_000}]
        if micros == max(SPENDS):
            limits.append({"period": "day", "ceiling_micros": 800})
        r = http.admin("PUT", f"/v1/admin/budgets/{budget_id}", json={"limits": limits})
        assert r.status_code == 200, r.text
        key = http.sidecar_key(budget_id)
        assert spend(http, key, micros).status_code == 200
        if i == 0:
            refused = spend(http, key, 10_000)
            assert refused.json()["error"]["code"] == "budget_exceeded"
        made.append(budget_id)
    return made


def scrape(http: Client, token: str = METRICS_TOKEN) -> dict[str, list[Sample]]:
    r = http.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def test_metrics_need_the_metrics_or_the_admin_token(http: Client) -> None:
    assert http.get("/metrics").status_code == 401
    for token in ("wrong", f"{METRICS_TOKEN}x", METRICS_TOKEN[:-1]):
        r = http.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
    assert set(scrape(http, METRICS_TOKEN)) == FAMILIES
    assert set(scrape(http, ADMIN_TOKEN)) == FAMILIES


def test_the_budget_gauges_are_the_ledgers_and_bounded_to_the_largest(
    http: Client, budgets: list[str]
) -> None:
    families = scrape(http)
    committed = {(s.labels["budget_id"], s.labels["period"]): s.value
                 for s in families["spend_ceiling_budget_committed_micros"]}
    shown = {budget_id for budget_id, _ in committed}
    by_spend = sorted(zip(SPENDS, budgets, strict=True), reverse=True)
    assert shown == {b for _, b in by_spend[:BUDGETS_MAX]}
    assert len(committed) == BUDGETS_MAX + 1  # the largest has a day and a total period
    ceilings = {(s.labels["budget_id"], s.labels["period"]): s.value
                for s in families["spend_ceiling_budget_ceiling_micros"]}
    reserved = {(s.labels["budget_id"], s.labels["period"]): s.value
                for s in families["spend_ceiling_budget_reserved_micros"]}
    for budget_id in shown:
        periods = http.admin("GET", f"/v1/admin/budgets/{budget_id}").json()["periods"]
        assert {p["period"] for p in periods} == {p for b, p in committed if b == budget_id}
        for p in periods:
            at = (budget_id, p["period"])
            assert committed[at] == p["committed_micros"]
            assert ceilings[at] == p["ceiling_micros"]
            assert reserved[at] == p["reserved_micros"] == 0


def test_refusals_the_ledger_and_this_instances_latency(http: Client,
                                                         budgets: list[str]) -> None:
    families = scrape(http)
    refusals = {s.labels["code"]: s.value for s in families["spend_ceiling_refusals"]
                if s.name == "spend_ceiling_refusals_total"}
    assert refusals == {"budget_exceeded": 1}
    [up] = families["spend_ceiling_ledger_up"]
    assert up.value == 1
    count = next(s.value for s in families["spend_ceiling_ledger_latency_seconds"]
                 if s.name == "spend_ceiling_ledger_latency_seconds_count")
    later = next(s.value for s in scrape(http)["spend_ceiling_ledger_latency_seconds"]
                 if s.name == "spend_ceiling_ledger_latency_seconds_count")
    assert later > count >= 1


def test_a_budgets_models_are_shown_beside_it_and_only_for_the_budgets_shown(
    http: Client, budgets: list[str]
) -> None:
    """Runs after the ranking above: the budget made here spends the most, so it is shown, with
    its model's windows; one that spends the least is not, nor are its models."""
    made = {}
    for micros in (900, 50):
        budget_id = f"org:p{uuid.uuid4().hex[:8]}"
        r = http.admin("PUT", f"/v1/admin/budgets/{budget_id}", json={
            "limits": [{"period": "total", "ceiling_micros": 10_000}],
            "per_model": {"gpt-4o-2024-08-06": {"limits": [
                {"period": "day", "ceiling_micros": 5_000},
                {"period": "total", "ceiling_micros": 6_000}]}}})
        assert r.status_code == 200, r.text
        key = http.sidecar_key(budget_id)
        held = http.post("/v1/reservations", headers=key, json={
            "model": "gpt-4o", "input_tokens": 100, "max_output_tokens": 100})
        assert held.status_code == 201, held.text
        settled = http.post(f"/v1/reservations/{held.json()['reservation_id']}/settle",
                            headers=key, json={"actual_micros": micros})
        assert settled.status_code == 200, settled.text
        made[micros] = budget_id
    families = scrape(http)
    series = {name: {(s.labels["budget_id"], s.labels["model"], s.labels["period"]): s.value
                     for s in families[f"spend_ceiling_budget_model_{name}_micros"]}
              for name in ("ceiling", "committed", "reserved")}
    top = made[900]
    assert set(series["committed"]) == {(top, "gpt-4o", "day"), (top, "gpt-4o", "total")}
    periods = http.admin("GET", f"/v1/admin/budgets/{top}").json()["per_model_periods"]
    for p in periods["gpt-4o"]:
        at = (top, "gpt-4o", p["period"])
        assert series["committed"][at] == p["committed_micros"] == 900
        assert series["ceiling"][at] == p["ceiling_micros"]
        assert series["reserved"][at] == p["reserved_micros"] == 0
    # The budget families show the budget itself, without a model label.
    committed = {(s.labels["budget_id"], s.labels["period"]): s.value
                 for s in families["spend_ceiling_budget_committed_micros"]}
    assert committed[(top, "total")] == 900
    assert not any(b == made[50] for b, _ in committed)


def test_a_ledger_that_does_not_answer_is_down_not_an_error(
    http: Client, ledger_redis: RedisServer, budgets: list[str]
) -> None:
    ledger_redis.stop()  # this module's Redis, the last test of the module
    families = scrape(http)
    [up] = families["spend_ceiling_ledger_up"]
    assert up.value == 0
    assert families["spend_ceiling_budget_committed_micros"] == []

