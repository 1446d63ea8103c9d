"""The stub's cost reports (infra/stub_costs.py): its own bill per UTC day, in each provider's
documented format. Like the stub's other tests, this imports nothing from `core`: the figures are
the bill's, read back through the report, and the formats the providers' documents.

OpenAI (developers.openai.com, GET /v1/organization/costs): daily buckets, `amount.value` a
number in dollars, currency "usd", `has_more` / `next_page`. Anthropic (platform.claude.com,
GET /v1/organizations/cost_report): `amount` "in lowest currency units (e.g. cents) as a decimal
string", currency "USD"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import httpx
import pytest

from infra.stub_costs import cost_control
from infra.stub_provider import StubProvider, fetch_bill, reset_bill

ADMIN_KEY = "sk-admin-stub"
HELLO = [{"role": "user", "content": "hello"}]
# What each call below costs the stub, worked in tests/infra/test_stub_provider.py ROUTES: "hello"
# in and 100 tokens out, gpt-4o 1,023 micro-dollars, claude-sonnet-4-5 1,527.
GPT_MICROS, SONNET_MICROS = 1_023, 1_527
OPENAI_HEADERS = {"authorization": f"Bearer {ADMIN_KEY}"}
ANTHROPIC_HEADERS = {"x-api-key": ADMIN_KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=4, latency_ms_min=0, latency_ms_max=1, admin_key=ADMIN_KEY) as s:
        yield s


@pytest.fixture
def http(stub: StubProvider) -> Iterator[httpx.Client]:
    reset_bill(stub.url)
    cost_control(stub.url, {})
    with httpx.Client(base_url=stub.url, timeout=10.0) as client:
        yield client


def today() -> date:
    return datetime.now(UTC).date()


def call_both(http: httpx.Client) -> None:
    fixed = {"X-Stub-Output-Tokens": "100"}
    assert http.post("/v1/chat/completions", headers=fixed, json={
        "model": "gpt-4o", "messages": HELLO, "max_tokens": 200}).status_code == 200
    assert http.post("/v1/messages", headers={**fixed, "anthropic-version": "2023-06-01"}, json={
        "model": "claude-sonnet-4-5", "messages": HELLO, "max_tokens": 200}).status_code == 200


def openai_report(http: httpx.Client, first: date, days: int, **params: Any) -> httpx.Response:
    start = int(datetime(first.year, first.month, first.day, tzinfo=UTC).timestamp())
    return http.get("/v1/organization/costs", headers=OPENAI_HEADERS, params={
        "start_time": start, "end_time": start + days * 86_400, **params})


def anthropic_report(http: httpx.Client, first: date, days: int, **params: Any
                     ) -> httpx.Response:
    return http.get("/v1/organizations/cost_report", headers=ANTHROPIC_HEADERS, params={
        "starting_at": f"{first.isoformat()}T00:00:00Z",
        "ending_at": f"{(first + timedelta(days=days)).isoformat()}T00:00:00Z", **params})


def test_the_reports_are_the_bill_in_dollars_and_in_cents(stub: StubProvider,
                                                          http: httpx.Client) -> None:
    call_both(http)
    call_both(http)
    assert fetch_bill(stub.url).total.cost_micros == 2 * (GPT_MICROS + SONNET_MICROS)
    day = today()
    doc = openai_report(http, day, 1).json()
    assert doc["object"] == "page"
    assert doc["has_more"] is False
    [bucket] = doc["data"]
    assert bucket["end_time"] - bucket["start_time"] == 86_400
    [result] = bucket["results"]
    assert result["amount"] == {"value": 0.002046, "currency": "usd"}  # 2 x 1,023 micros in $
    doc = anthropic_report(http, day, 1).json()
    [bucket] = doc["data"]
    assert (bucket["starting_at"], bucket["ending_at"]) == (
        f"{day.isoformat()}T00:00:00Z", f"{(day + timedelta(days=1)).isoformat()}T00:00:00Z")
    [result] = bucket["results"]
    assert (result["amount"], result["currency"]) == ("0.3054", "USD")  # 2 x 1,527 micros in ¢


def test_pages_scale_errors_and_currency(stub: StubProvider, http: httpx.Client) -> None:
    call_both(http)
    first = today() - timedelta(days=2)
    cost_control(stub.url, {"buckets_per_page_max": 2, "scale": "2"})
    page1 = anthropic_report(http, first, 3).json()
    assert [b["results"] for b in page1["data"]] == [[], []]
    assert page1["has_more"] is True
    page2 = anthropic_report(http, first, 3, page=page1["next_page"]).json()
    assert page2["has_more"] is False
    assert page2["next_page"] is None
    assert [r["amount"] for r in page2["data"][0]["results"]] == ["0.3054"]  # twice the bill
    assert openai_report(http, first, 3, limit=1).json()["has_more"] is True
    cost_control(stub.url, {"mode": "error"})
    assert openai_report(http, first, 3).status_code == 500
    assert anthropic_report(http, first, 3).json()["type"] == "error"
    cost_control(stub.url, {"mode": "non_usd"})
    assert openai_report(http, today(), 1).json()["data"][0]["results"][0]["amount"][
        "currency"] == "eur"
    cost_control(stub.url, {"mode": "malformed"})
    assert isinstance(anthropic_report(http, today(), 1).json()["data"][0]["results"][0][
        "amount"], float)


def test_the_reports_need_the_admin_key_and_a_new_bill_empties_them(
        stub: StubProvider, http: httpx.Client) -> None:
    call_both(http)
    assert http.get("/v1/organization/costs", params={"start_time": int(time.time())},
                    headers={"authorization": "Bearer sk-not-admin"}).status_code == 401
    assert http.get("/v1/organizations/cost_report", params={"starting_at": "2026-01-01T00:00:00Z"},
                    headers={"x-api-key": "nope", "anthropic-version": "2023-06-01"}
                    ).status_code == 401
    assert http.get("/v1/organizations/cost_report", params={"starting_at": "2026-01-01T00:00:00Z"},
                    headers={"x-api-key": ADMIN_KEY}).status_code == 400
    assert openai_report(http, today(), 1, project_ids="proj_other").json()["data"][0][
        "results"] == []
    reset_bill(stub.url)
    assert openai_report(http, today(), 1).json()["data"][0]["results"] == []
