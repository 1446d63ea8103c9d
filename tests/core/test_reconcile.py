"""Reconciliation's core (core/reconcile.py): both providers' cost report formats read to the
micro-dollar (OpenAI's dollars as JSON numbers, Anthropic's cents as decimal strings), every page
read, and every way a report can fail an error, never a zero; then the comparison per day, and
one drift event per day beyond the tolerance.

The reports here are written by hand in each provider's documented shape; the stub's reports
(infra/stub_costs.py) are read end to end in tests/api/test_reconcile.py."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

import pytest

from core.alerts import DRIFT, EXCEEDED, AlertEvent, payload
from core.config import ConfigError
from core.errors import CeilingError, InvalidRequest
from core.ledger import DriftEvent, Upstream
from core.reconcile import (
    COST_REPORTS,
    RECONCILE_DAYS_MAX,
    REPORT_PAGES_MAX,
    AnthropicCosts,
    CostReportFailed,
    Fetch,
    OpenAICosts,
    ReportSource,
    compare,
    day_range,
    provider_of,
    provider_spend_by_day,
    reconcile,
    tolerance_of,
    within,
)

parse_openai_page = OpenAICosts().parse_page
parse_anthropic_page = AnthropicCosts().parse_page
DAY = date(2026, 3, 14)
DAY_S = 1_773_446_400  # 2026-03-14T00:00:00Z
SOURCES = {
    Upstream.OPENAI: ReportSource(Upstream.OPENAI, "https://openai.test", "sk-admin"),
    Upstream.ANTHROPIC: ReportSource(Upstream.ANTHROPIC, "https://anthropic.test",
                                     "sk-ant-admin"),
}


def openai_bucket(day: date, *values: Any, currency: str = "usd") -> dict[str, Any]:
    start = DAY_S + (day - DAY).days * 86_400
    return {"object": "bucket", "start_time": start, "end_time": start + 86_400,
            "results": [{"object": "organization.costs.result",
                         "amount": {"value": v, "currency": currency},
                         "line_item": None, "project_id": None} for v in values]}


def anthropic_bucket(day: date, *cents: Any, currency: str = "USD") -> dict[str, Any]:
    return {"starting_at": f"{day.isoformat()}T00:00:00Z",
            "ending_at": f"{(day + timedelta(days=1)).isoformat()}T00:00:00Z",
            "results": [{"currency": currency, "amount": c, "workspace_id": None,
                         "description": None} for c in cents]}


def page(buckets: list[Any], next_page: str | None = None) -> bytes:
    # Written by hand, not by json.dumps of floats, where the exact text matters.
    return json.dumps({"object": "page", "data": buckets, "has_more": next_page is not None,
                       "next_page": next_page}).encode()


def raw_page(buckets_text: str) -> bytes:
    return ('{"object": "page", "data": [' + buckets_text
            + '], "has_more": false, "next_page": null}').encode()


class Pages:
    """A provider answering a list of (status, body) in turn, recording each query."""

    def __init__(self, *answers: tuple[int, bytes]) -> None:
        self.answers = list(answers)
        self.queries: list[dict[str, list[str]]] = []
        self.headers: list[dict[str, str]] = []

    async def __call__(self, url: str, params: Sequence[tuple[str, str]],
                       headers: Mapping[str, str]) -> tuple[int, bytes]:
        query: dict[str, list[str]] = {}
        for k, v in params:
            query.setdefault(k, []).append(v)
        self.queries.append(query)
        self.headers.append(dict(headers))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def read(provider: Upstream, fetch: Fetch, first: date = DAY,
               last: date = DAY) -> dict[date, int]:
    return await provider_spend_by_day(SOURCES[provider], first, last, fetch)


# -- the formats ----------------------------------------------------------------------------------


def test_openai_dollars_are_read_exactly_and_a_day_is_rounded_once_half_up() -> None:
    # 1.5 micro-dollars: as a binary float times a million it is 1.4999999999999998, which
    # would round down; read as a decimal it is exactly half and rounds up.
    found = parse_openai_page(raw_page(
        '{"object": "bucket", "start_time": 1773446400, "end_time": 1773532800, "results": ['
        '{"amount": {"value": 0.0000015, "currency": "usd"}}]},'
        '{"object": "bucket", "start_time": 1773532800, "end_time": 1773619200, "results": ['
        '{"amount": {"value": 0.1, "currency": "usd"}}, '
        '{"amount": {"value": 0.2, "currency": "USD"}}, '
        '{"amount": {"value": 3, "currency": "usd"}}]}'))
    assert found.micros_by_day == {DAY: Decimal("1.5"),
                                   DAY + timedelta(days=1): Decimal("3300000.0")}
    assert not found.has_more


def test_anthropic_cents_strings_are_read_as_cents() -> None:
    found = parse_anthropic_page(page([anthropic_bucket(DAY, "123.45", "0.00005"),
                                       anthropic_bucket(DAY + timedelta(days=1))]))
    # "123.45" cents is $1.2345: 1,234,500 micro-dollars, not 123,450,000.
    assert found.micros_by_day == {DAY: Decimal("1234500.5"), DAY + timedelta(days=1): 0}


async def test_each_day_is_summed_exactly_then_rounded_half_up() -> None:
    fetch = Pages((200, page([anthropic_bucket(DAY, "0.00005", "0.00005", "0.00004")])))
    # 0.5 + 0.5 + 0.4 micros is 1.4: rounded once per day, not once per result (which says 2).
    assert await read(Upstream.ANTHROPIC, fetch) == {DAY: 1}
    fetch = Pages((200, raw_page(
        '{"start_time": 1773446400, "end_time": 1773532800, "results": ['
        '{"amount": {"value": 0.0000025, "currency": "usd"}}]}')))
    assert await read(Upstream.OPENAI, fetch) == {DAY: 3}


async def test_the_first_query_is_the_documented_one() -> None:
    source = ReportSource(Upstream.OPENAI, "https://openai.test", "sk-admin",
                          ("proj_a", "proj_b"))
    fetch = Pages((200, page([])))
    await provider_spend_by_day(source, DAY, DAY + timedelta(days=2), fetch)
    assert fetch.queries == [{"start_time": [str(DAY_S)],
                              "end_time": [str(DAY_S + 3 * 86_400)], "bucket_width": ["1d"],
                              "limit": ["3"], "project_ids": ["proj_a", "proj_b"]}]
    assert fetch.headers[0]["authorization"] == "Bearer sk-admin"
    fetch = Pages((200, page([])))
    await read(Upstream.ANTHROPIC, fetch, DAY, DAY + timedelta(days=40))
    assert fetch.queries == [{"starting_at": ["2026-03-14T00:00:00Z"],
                              "ending_at": ["2026-04-24T00:00:00Z"], "bucket_width": ["1d"],
                              "limit": ["31"]}]
    assert fetch.headers[0]["x-api-key"] == "sk-ant-admin"
    assert fetch.headers[0]["anthropic-version"] == "2023-06-01"


@pytest.mark.parametrize("provider", list(Upstream))
async def test_every_page_is_read_through_next_page(provider: Upstream) -> None:
    bucket = openai_bucket if provider is Upstream.OPENAI else anthropic_bucket
    amount = (lambda m: m / 1_000_000) if provider is Upstream.OPENAI else (
        lambda m: str(Decimal(m) / 10_000))
    days = [DAY + timedelta(days=i) for i in range(5)]
    fetch = Pages(
        (200, page([bucket(days[0], amount(10)), bucket(days[1], amount(20))], "p2")),
        (200, page([bucket(days[2], amount(30)), bucket(days[3])], "p3")),
        (200, page([bucket(days[4], amount(50))])))
    found = await read(provider, fetch, days[0], days[4])
    assert found == {days[0]: 10, days[1]: 20, days[2]: 30, days[3]: 0, days[4]: 50}
    assert [q.get("page") for q in fetch.queries] == [None, ["p2"], ["p3"]]


# -- a report that fails is an error, never a zero -------------------------------------------


@pytest.mark.parametrize("provider", list(Upstream))
@pytest.mark.parametrize("status", [401, 429, 500, 503])
async def test_an_error_answer_is_an_error(provider: Upstream, status: int) -> None:
    body = json.dumps({"error": {"message": "the admin key is not valid: sk-admin",
                                 "type": "x"}}).encode()
    with pytest.raises(CostReportFailed) as caught:
        await read(provider, Pages((status, body)))
    assert caught.value.details["reason"] == "http_status"
    assert caught.value.details["status"] == status
    assert "the admin key is not valid" in caught.value.message
    # The admin key is never in an error, not even where the provider quoted it.
    assert SOURCES[provider].admin_key not in caught.value.message


async def test_an_error_on_a_later_page_is_an_error_not_the_pages_before() -> None:
    fetch = Pages((200, page([anthropic_bucket(DAY, "100")], "p2")), (502, b"bad gateway"))
    with pytest.raises(CostReportFailed):
        await read(Upstream.ANTHROPIC, fetch, DAY, DAY + timedelta(days=1))


@pytest.mark.parametrize(("provider", "body"), [
    (Upstream.OPENAI, page([openai_bucket(DAY, 0.5, currency="eur")])),
    (Upstream.ANTHROPIC, page([anthropic_bucket(DAY, "50", currency="EUR")])),
    # A zero in another currency is still not a report in dollars.
    (Upstream.OPENAI, page([openai_bucket(DAY, 0, currency="gbp")])),
])
async def test_an_amount_not_in_us_dollars_is_an_error(provider: Upstream, body: bytes) -> None:
    with pytest.raises(CostReportFailed) as caught:
        await read(provider, Pages((200, body)))
    assert caught.value.details["reason"] == "currency"


MALFORMED = [
    (Upstream.OPENAI, b"<html>maintenance</html>"),
    (Upstream.OPENAI, b"[]"),
    (Upstream.OPENAI, b'{"object": "page", "has_more": false}'),
    (Upstream.OPENAI, b'{"data": [], "next_page": null}'),
    (Upstream.OPENAI, b'{"data": [], "has_more": true, "next_page": null}'),
    (Upstream.OPENAI, page([openai_bucket(DAY, "0.06")])),  # a string where a number is
    (Upstream.OPENAI, page([openai_bucket(DAY, None)])),
    (Upstream.OPENAI, page([openai_bucket(DAY, True)])),
    (Upstream.OPENAI, page([{**openai_bucket(DAY, 1), "start_time": DAY_S + 3600}])),
    (Upstream.OPENAI, page([{**openai_bucket(DAY, 1), "end_time": DAY_S + 2 * 86_400}])),
    (Upstream.OPENAI, page([{**openai_bucket(DAY, 1), "results": [{"amount": None}]}])),
    (Upstream.OPENAI, page([{**openai_bucket(DAY, 1), "results": [{"amount": {"value": 1}}]}])),
    (Upstream.OPENAI, raw_page('{"start_time": 1773446400, "end_time": 1773532800, "results": '
                               '[{"amount": {"value": NaN, "currency": "usd"}}]}')),
    (Upstream.OPENAI, raw_page('{"start_time": 1773446400, "end_time": 1773532800, "results": '
                               '[{"amount": {"value": 1e400, "currency": "usd"}}]}')),
    (Upstream.ANTHROPIC, page([anthropic_bucket(DAY, 123.45)])),  # a number where a string is
    (Upstream.ANTHROPIC, page([anthropic_bucket(DAY, "12,34")])),
    (Upstream.ANTHROPIC, page([anthropic_bucket(DAY, "1e3")])),
    (Upstream.ANTHROPIC, page([anthropic_bucket(DAY, "")])),
    (Upstream.ANTHROPIC, page([{**anthropic_bucket(DAY, "1"), "starting_at": "yesterday"}])),
    (Upstream.ANTHROPIC, page([{**anthropic_bucket(DAY, "1"),
                                "starting_at": "2026-03-14T00:00:00"}])),  # no offset
    (Upstream.ANTHROPIC, page([{**anthropic_bucket(DAY, "1"),
                                "starting_at": "2026-03-14T06:00:00Z"}])),
    (Upstream.ANTHROPIC, page([{"starting_at": "2026-03-14T00:00:00Z",
                                "ending_at": "2026-03-15T00:00:00Z"}])),
]


@pytest.mark.parametrize(("provider", "body"), MALFORMED)
async def test_a_malformed_report_is_an_error(provider: Upstream, body: bytes) -> None:
    with pytest.raises(CostReportFailed) as caught:
        await read(provider, Pages((200, body)))
    assert caught.value.details["reason"] == "malformed"
    assert isinstance(caught.value, CeilingError)


async def test_a_report_that_never_ends_is_an_error() -> None:
    endless = Pages((200, page([], "again")))
    with pytest.raises(CostReportFailed):  # the same page named twice
        await read(Upstream.OPENAI, endless)
    counter = iter(range(10 * REPORT_PAGES_MAX))

    async def more(url: str, params: Sequence[tuple[str, str]],
                   headers: Mapping[str, str]) -> tuple[int, bytes]:
        return 200, page([], f"p{next(counter)}")

    with pytest.raises(CostReportFailed) as caught:
        await read(Upstream.OPENAI, more)
    assert caught.value.details["reason"] == "pages"


async def test_days_outside_the_range_are_not_counted() -> None:
    fetch = Pages((200, page([anthropic_bucket(DAY - timedelta(days=1), "900"),
                              anthropic_bucket(DAY, "100")])))
    assert await read(Upstream.ANTHROPIC, fetch) == {DAY: 1_000_000}


# -- comparing ------------------------------------------------------------------------------------


def test_drift_is_against_the_larger_side_and_both_zero_is_within() -> None:
    days = [DAY + timedelta(days=i) for i in range(4)]
    done = compare(Upstream.OPENAI, {days[0]: 1_000_000, days[1]: 1_000_000, days[3]: 5},
                   {days[0]: 1_010_000, days[1]: 2_000_000, days[2]: 0},
                   days[0], days[3], Decimal(1))
    assert [(d.day, d.drift_micros, d.drift_pct, d.within) for d in done.days] == [
        (days[0], 10_000, Decimal("0.9901"), True),
        (days[1], 1_000_000, Decimal("50.0000"), False),
        (days[2], 0, Decimal(0), True),
        (days[3], -5, Decimal("100.0000"), False),  # the ledger spent, the report has nothing
    ]
    assert not done.within
    assert [d.day for d in done.beyond] == [days[1], days[3]]
    assert done.json() == {
        "provider": "openai", "tolerance_pct": 1.0, "within": False,
        "days": [{"day": d.day.isoformat(), "ledger_micros": d.ledger_micros,
                  "provider_micros": d.provider_micros, "drift_micros": d.drift_micros,
                  "drift_pct": float(d.drift_pct), "within": d.within} for d in done.days]}
    lines = "\n".join(done.lines())
    assert "beyond tolerance: 2026-03-15 drift +$1.000000 (50.00%)" in lines


def test_within_is_decided_exactly_at_the_edge() -> None:
    assert within(99, 100, Decimal(1))  # 1 of 100: exactly 1%
    assert not within(98, 100, Decimal(1))
    assert within(100, 100, Decimal(0))
    assert not within(100, 101, Decimal(0))
    assert within(0, 0, Decimal(0))


@pytest.mark.parametrize("text", ["-1", "101", "nan", "inf", "x", "1" * 30])
def test_a_tolerance_outside_zero_to_a_hundred_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        tolerance_of(text)


def test_tolerances_are_decimals() -> None:
    assert tolerance_of(None) == tolerance_of("") == Decimal(1)
    assert tolerance_of("0.5") == Decimal("0.5")


def test_the_default_range_is_the_week_up_to_yesterday() -> None:
    assert day_range(None, None, DAY) == (DAY - timedelta(days=7), DAY - timedelta(days=1))
    assert day_range("2026-03-14", None, DAY) == (DAY, DAY)
    assert day_range(None, "2026-03-14", DAY) == (DAY - timedelta(days=6), DAY)
    assert day_range("2026-03-01", "2026-03-02", DAY) == (date(2026, 3, 1), date(2026, 3, 2))


@pytest.mark.parametrize(("first", "last"), [
    ("2026-03-15", None), (None, "2026-03-15"), ("2026-03-10", "2026-03-09"),
    ("2026-3-1", None), ("2026-02-30", None), ("yesterday", None),
    ((DAY - timedelta(days=RECONCILE_DAYS_MAX)).isoformat(), None),
])
def test_a_range_the_ledger_cannot_answer_is_refused(first: str | None,
                                                     last: str | None) -> None:
    with pytest.raises(InvalidRequest):
        day_range(first, last, DAY)


def test_a_provider_is_picked_by_name_from_the_registry() -> None:
    for provider, report in COST_REPORTS.items():
        assert report.provider is provider
        assert provider_of(str(provider)) is provider
    with pytest.raises(InvalidRequest, match="'openai' or 'anthropic'"):
        provider_of("gemini")
    with pytest.raises(InvalidRequest):
        provider_of(None)


def test_a_report_source_needs_its_admin_key() -> None:
    with pytest.raises(ConfigError, match="CEILING_OPENAI_ADMIN_KEY"):
        ReportSource.from_env(Upstream.OPENAI, {})
    with pytest.raises(ConfigError, match="CEILING_ANTHROPIC_ADMIN_URL"):
        ReportSource.from_env(Upstream.ANTHROPIC, {"CEILING_ANTHROPIC_ADMIN_KEY": "k",
                                                   "CEILING_ANTHROPIC_ADMIN_URL": "ftp://x"})
    with pytest.raises(ConfigError, match="CEILING_OPENAI_PROJECT_ID"):
        ReportSource.from_env(Upstream.OPENAI, {"CEILING_OPENAI_ADMIN_KEY": "k",
                                                "CEILING_OPENAI_PROJECT_ID": "a b"})
    source = ReportSource.from_env(Upstream.OPENAI, {"CEILING_OPENAI_ADMIN_KEY": "k",
                                                     "CEILING_OPENAI_PROJECT_ID": "proj_1,proj_2"})
    assert (source.url, source.project_ids) == ("https://api.openai.com/v1/organization/costs",
                                               ("proj_1", "proj_2"))
    source = ReportSource.from_env(Upstream.ANTHROPIC, {
        "CEILING_ANTHROPIC_ADMIN_KEY": "k", "CEILING_ANTHROPIC_ADMIN_URL": "http://127.0.0.1:9/"})
    assert source.url == "http://127.0.0.1:9/v1/organizations/cost_report"


# -- the whole of it ------------------------------------------------------------------------------


class Ledger:
    """The ledger's side of a reconciliation, kept in memory: its clock, its gateway spend per
    day, and the drift events it put, each once per provider and day."""

    def __init__(self, now_day: date, spend: dict[date, int]) -> None:
        self.now_day = now_day
        self.spend = spend
        self.events: list[DriftEvent] = []
        self.asked: list[tuple[Upstream, date, date]] = []

    async def ledger_time_ms(self) -> int:
        return (DAY_S + (self.now_day - DAY).days * 86_400) * 1000 + 3_600_000

    async def gateway_spend_by_day(self, upstream: Upstream, first_day: date, last_day: date
                                   ) -> dict[date, int]:
        self.asked.append((upstream, first_day, last_day))
        return {d: m for d, m in self.spend.items() if first_day <= d <= last_day}

    async def emit_drift_alert(self, event: DriftEvent) -> bool:
        if any((e.provider, e.day) == (event.provider, event.day) for e in self.events):
            return False
        self.events.append(event)
        return True

    async def refusal_counts(self) -> dict[str, int]:
        return {}


async def test_each_day_beyond_the_tolerance_puts_one_drift_event() -> None:
    yesterday = DAY - timedelta(days=1)
    ledger = Ledger(DAY, {yesterday: 40_000, DAY - timedelta(days=2): 10_000})
    report = page([anthropic_bucket(DAY - timedelta(days=2), "1"),  # 10,000 micros: agrees
                   anthropic_bucket(yesterday, "8")])  # 80,000 micros: twice the ledger
    for _ in range(2):
        done = await reconcile(ledger, SOURCES[Upstream.ANTHROPIC], None, None, Decimal(1),
                               Pages((200, report)))
        assert [(d.day, d.within) for d in done.days if d.ledger_micros] == [
            (DAY - timedelta(days=2), True), (yesterday, False)]
    assert ledger.asked[0] == (Upstream.ANTHROPIC, DAY - timedelta(days=7), yesterday)
    assert ledger.events == [DriftEvent(Upstream.ANTHROPIC, yesterday, 40_000, 80_000)]


async def test_a_failed_report_puts_no_event_and_reads_no_zero() -> None:
    ledger = Ledger(DAY, {DAY: 40_000})
    with pytest.raises(CostReportFailed):
        await reconcile(ledger, SOURCES[Upstream.OPENAI], "2026-03-14", "2026-03-14",
                        Decimal(1), Pages((500, b"{}")))
    assert ledger.events == []


# -- the drift event's body -----------------------------------------------------------------------


def drift_fields() -> dict[str, str]:
    return {"event_id": "evt_1", "type": DRIFT, "budget_id": "", "period_key": "day:2026-03-14",
            "threshold_pct": "", "committed_micros": "40000", "ceiling_micros": "0",
            "at_ms": "1", "attempts": "0", "state": "pending", "provider": "openai",
            "day": "2026-03-14", "ledger_micros": "40000", "provider_micros": "80000"}


def test_a_drift_events_body_names_the_provider_the_day_and_both_sides() -> None:
    body = json.loads(payload("https://hooks.test/x",
                              AlertEvent.from_fields("ledger", drift_fields())))
    assert body == {"event_id": "evt_1", "type": "ledger.drift", "budget_id": "",
                    "period": "day", "period_key": "day:2026-03-14", "threshold_pct": None,
                    "committed_micros": 40000, "ceiling_micros": 0, "at_ms": 1,
                    "provider": "openai", "day": "2026-03-14", "ledger_micros": 40000,
                    "provider_micros": 80000}
    slack = json.loads(payload("https://hooks.slack.com/services/x",
                               AlertEvent.from_fields("ledger", drift_fields())))
    assert "openai" in slack["text"]
    assert "2026-03-14" in slack["text"]


def test_a_budget_events_body_is_as_it_was() -> None:
    fields = {"event_id": "evt_2", "type": EXCEEDED, "budget_id": "org:a",
              "period_key": "day:2026-03-14", "threshold_pct": "", "committed_micros": "5",
              "ceiling_micros": "5", "at_ms": "1"}
    assert set(AlertEvent.from_fields("org:a", fields).body()) == {
        "event_id", "type", "budget_id", "period", "period_key", "threshold_pct",
        "committed_micros", "ceiling_micros", "at_ms"}
