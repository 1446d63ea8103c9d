"""Does the ledger match the invoice: the ledger's gateway spend per UTC day against a provider's
cost report.

The ledger counts, per upstream and UTC day, what settles committed for gateway calls
(core/ledger.py Reconciliation). A provider's cost report is the only witness of what it will
invoice. Each provider's is one CostReport (OpenAICosts: dollars as JSON numbers; AnthropicCosts:
cents as decimal strings), registered by its name in COST_REPORTS; the rest of this module names
no provider. Every report is daily buckets read with an admin key, a page at a time through
`has_more` / `next_page`, and turned into integer micro-dollars exactly: JSON numbers are
parsed as Decimal, never as binary floats, a day's results are summed exactly and rounded once,
half up, to a micro-dollar.

A report that cannot be read whole (the request failed or timed out, an error answer, a page
that is not the documented shape, an amount that is not US dollars) is CostReportFailed, never
a zero: a zero would read as "the provider billed nothing", the one answer that hides a drift.
A day the report has no bucket for is a day the provider billed nothing; if the ledger spent on
it, it shows as drift.

Drift, per day: drift_micros = provider_micros - ledger_micros (positive: the provider billed
more than the ledger saw), and drift_pct = |drift_micros| / max(|provider|, |ledger|) x 100, so
that it is defined whichever side is zero and never passes 100. A day where both are zero has
no drift. A day is within the tolerance when drift_pct <= tolerance_pct, decided exactly (the
shown drift_pct is rounded). Each day beyond it puts one `ledger.drift` event in the alert
outbox, once per provider and day whoever reconciles it again (Reconciliation.emit_drift_alert):
the webhook delivery posts it, signed, as it posts every alert.

Booking unseen spend (`book_into`, a budget id): what a provider billed for a day beyond what the
ledger saw is charged to that budget as committed spend, in its current windows and those of
every budget on its path, as a settle would charge it, so that the next call that no longer fits
is refused. The unseen amount of a day is `unseen_micros`: nothing while the day is within the
tolerance or the ledger saw more than the provider billed (a drift below zero books nothing and
gives nothing back), otherwise the whole of drift_micros, not only the part past the tolerance:
the tolerance decides whether the two sides disagree, and once they do, all that the provider
billed and no settle counted is spend the ceiling did not see, less the day's unattributed
spend (sidecar reservations of an amount, which may be on any provider's bill: booked again,
they would be charged twice). The ledger keeps what it booked per provider, day and
organisation (lua/book_unseen.lua) and books only `unseen - booked so far` (what any
organisation booked counts), in one step that records the new total, holding the ledger's one
booking lease for the provider (a run that finds it held books nothing and says so): a repeat
books nothing, two instances at once, into one organisation or two, book the day once, a later
report with more spend books the difference. The day goes into the budgets' current windows
that hold it (total always), as the day's spend, never as this hour's velocity. Booked spend is
not "what the ledger saw": the comparison stays the provider against the settles (so the drift
still shows, and its alert still says so), and what was booked is subtracted only from what is
booked next. A settle that lands after a booking (a call whose settle came late) makes the next
run's unseen smaller; nothing booked is taken back, since unknown means held. Each booking is a
`ledger.unseen_booked` event (the budget's tag's outbox, written in the step that books) and an
audit entry, written once per total booked by any run that finds it missing
(lua/audit_booked.lua). A report that cannot be read whole books nothing, as it compares
nothing; a `book_into` that is not an operator's budget id, or names no budget, is refused
before the report is read.

The HTTP request itself is given (api/routes/reconcile.py): core imports no HTTP client.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any, Protocol

from core.alerts import UNSEEN_BOOKED, event_id_of
from core.audit import audit_fields
from core.budgets import BudgetId
from core.config import ConfigError
from core.errors import BudgetNotFound, CostReportFailed, InvalidRequest
from core.ledger import BudgetCatalogue, DriftEvent, Reconciliation, Upstream
from core.limits import DAILY_SPEND_DAYS_MAX, INT_EXACT_MAX
from core.money import MICROS_PER_USD, micros_to_usd
from core.operations import AUDIT_RETENTION_MS

__all__ = ["Booking", "CostReportFailed", "DayDrift", "Reconciled", "ReportSource", "reconcile"]

# A report that gives its amounts in cents (AnthropicCosts) is read at this many a cent.
MICROS_PER_CENT = MICROS_PER_USD // 100
# The longest range (DAILY_SPEND_DAYS_MAX days) takes a few times fewer pages than this even at
# 31 buckets a page (the fewest a provider's report takes); a report that still says `has_more`
# after this many pages is not ending, and is refused rather than read for ever.
REPORT_PAGES_MAX = 64
# The most a page of a report may hold. 180 daily buckets grouped by project and line item are
# far below it; more is not a cost report, and is not read into memory.
REPORT_PAGE_BYTES_MAX = 16 * 1024 * 1024
# Characters of a provider's error message kept in the error: enough to read the cause.
REPORT_ERROR_CHARS_MAX = 300
# What one report request may take, connecting included: reports are computed on demand, and a
# range of a year can take seconds.
REPORT_TIMEOUT_S = 60.0
# Days one reconciliation compares: as far back as the ledger keeps a day's gateway spend.
RECONCILE_DAYS_MAX = DAILY_SPEND_DAYS_MAX
# Days compared when no range is given: the week up to yesterday (UTC). Today is left out by
# default because providers add a day's costs to their reports hours after the calls, so today
# would show drift that is only lag; a daily run compares every day a week long.
RECONCILE_DAYS_DEFAULT = 7
TOLERANCE_PCT_DEFAULT = Decimal(1)
# drift_pct is shown to this many decimal places (the decision uses the exact ratio).
DRIFT_PCT_PLACES = Decimal("0.0001")
# The projects a report may be narrowed to (CostReport.project_ids), as a setting lists them.
PROJECTS_MAX = 100
_PROJECT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# A decimal as a report may write an amount in a string: digits, an optional fraction, an
# optional sign.
_DECIMAL = re.compile(r"-?[0-9]{1,20}(?:\.[0-9]{1,20})?")
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
SECONDS_PER_DAY = 86_400
# How long a run holds a provider's booking lease at most: a booking is one script per day of at
# most RECONCILE_DAYS_MAX, seconds in all; a run that dies holding it leaves it to expire, and
# the next scheduled run (a day later) books what it did not.
BOOKING_LEASE_MS = 120_000
ONE_DAY = timedelta(days=1)


# -- reading a report -----------------------------------------------------------------------------


Fetch = Callable[[str, Sequence[tuple[str, str]], Mapping[str, str]], Awaitable[tuple[int, bytes]]]
"""GETs a URL with a query and headers; returns the status and the body (at most
REPORT_PAGE_BYTES_MAX of it). Raises CostReportFailed when no answer came (unreachable, timed
out, too large)."""


@dataclass(frozen=True)
class ReportPage:
    """One page of a report: exact micro-dollars per UTC day, and where the next page is."""

    micros_by_day: dict[date, Decimal]
    has_more: bool
    next_page: str | None


def failed(provider: Upstream, reason: str, message: str, **details: Any) -> CostReportFailed:
    """The error for a report that could not be read. `reason`: unreachable, http_status,
    malformed, currency, pages."""
    return CostReportFailed(f"{provider}'s cost report could not be read: {message}",
                            provider=str(provider), reason=reason, **details)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _document(provider: Upstream, body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body, parse_float=Decimal, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise failed(provider, "malformed", f"not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise failed(provider, "malformed", "not a JSON object")
    return doc


def _pagination(provider: Upstream, doc: dict[str, Any]) -> tuple[list[Any], bool, str | None]:
    data, has_more, next_page = doc.get("data"), doc.get("has_more"), doc.get("next_page")
    if not isinstance(data, list):
        raise failed(provider, "malformed", "no `data` list")
    if not isinstance(has_more, bool):
        raise failed(provider, "malformed", "no `has_more` boolean")
    if next_page is not None and not isinstance(next_page, str):
        raise failed(provider, "malformed", "`next_page` is not a string")
    if has_more and not next_page:
        raise failed(provider, "malformed", "`has_more` without a `next_page`")
    return data, has_more, next_page


def bucket_day(provider: Upstream, start: datetime, end: datetime) -> date:
    """The UTC day a bucket covers: it starts at a midnight, UTC, and ends by the next one (the
    current day's bucket may end earlier). Any other bucket cannot be compared day by day."""
    if (start.hour, start.minute, start.second, start.microsecond) != (0, 0, 0, 0) or not (
            start < end <= start + ONE_DAY):
        raise failed(provider, "malformed",
                     f"a bucket from {start.isoformat()} to {end.isoformat()} is not one UTC day")
    return start.date()


def check_usd(provider: Upstream, currency: object) -> None:
    if not isinstance(currency, str):
        raise failed(provider, "malformed", "an amount without a currency")
    if currency.lower() != "usd":
        raise failed(provider, "currency", f"an amount in {currency[:16]!r}, not US dollars",
                     currency=currency[:16])


def instant(provider: Upstream, text: object) -> datetime:
    """An RFC 3339 time with its offset, in UTC."""
    if not isinstance(text, str) or len(text) > 40:
        raise failed(provider, "malformed", "a bucket without RFC 3339 starting_at and ending_at")
    try:
        found = datetime.fromisoformat(text)
    except ValueError as exc:
        raise failed(provider, "malformed", f"{text!r} is not an RFC 3339 time") from exc
    if found.tzinfo is None:
        raise failed(provider, "malformed", f"{text!r} has no UTC offset")
    return found.astimezone(UTC)


def unix_s(day: date) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp())


def rfc3339(day: date) -> str:
    return f"{day.isoformat()}T00:00:00Z"


class CostReport(ABC):
    """One provider's cost report: where it is read and with which admin key, the query of a
    range of days, and how a page's buckets and amounts are read, in the report's own unit.

    Every report is daily buckets of results, a page at a time through `has_more` /
    `next_page`; what differs is here. A new provider's report is one subclass, and its entry in
    COST_REPORTS."""

    provider: Upstream
    key_setting: str  # the variable naming its admin key
    url_setting: str  # the variable naming its base URL (without /v1)
    url_default: str  # the provider's own base URL
    path: str  # the report's path below the base URL
    # Buckets one page may hold, as the provider documents its `limit` for daily buckets: asking
    # for the most there are takes the fewest pages.
    buckets_per_page_max: int

    @abstractmethod
    def headers(self, admin_key: str) -> dict[str, str]:
        """The headers that carry the admin key (and what else the report asks for)."""

    @abstractmethod
    def params(self, first_day: date, end: date, limit: int,
               project_ids: tuple[str, ...]) -> list[tuple[str, str]]:
        """The query of the first page: the days from `first_day` to `end` (excluded), `limit`
        buckets a page; later pages add `page`."""

    def project_ids(self, env: Mapping[str, str]) -> tuple[str, ...]:
        """The projects the report is narrowed to, as the environment names them: none (the
        whole organisation) unless the provider's report takes such a filter."""
        del env
        return ()

    @abstractmethod
    def bucket(self, bucket: object) -> tuple[date, list[Any]]:
        """A bucket's UTC day (bucket_day) and its results."""

    @abstractmethod
    def result_micros(self, result: object, day: date) -> Decimal:
        """One result's amount, in exact micro-dollars, once its currency is checked."""

    def parse_page(self, body: bytes) -> ReportPage:
        """One page: every bucket's results summed exactly per day."""
        data, has_more, next_page = _pagination(self.provider, _document(self.provider, body))
        by_day: dict[date, Decimal] = {}
        for given in data:
            day, results = self.bucket(given)
            total = by_day.get(day, Decimal(0))
            for result in results:
                total += self.result_micros(result, day)
            by_day[day] = total
        return ReportPage(by_day, has_more, next_page)


# -- the providers' reports -----------------------------------------------------------------------


class OpenAICosts(CostReport):
    """OpenAI's `GET /v1/organization/costs`: `{"object": "page", "data": [{"object": "bucket",
    "start_time", "end_time", "results": [{"amount": {"value": <dollars>, "currency": "usd"},
    ...}]}], "has_more", "next_page"}`, amounts JSON numbers in dollars, filtered by
    `project_ids` if CEILING_OPENAI_PROJECT_ID lists any."""

    provider = Upstream.OPENAI
    key_setting = "CEILING_OPENAI_ADMIN_KEY"
    url_setting = "CEILING_OPENAI_ADMIN_URL"
    url_default = "https://api.openai.com"
    path = "/v1/organization/costs"
    buckets_per_page_max = 180
    projects_setting = "CEILING_OPENAI_PROJECT_ID"

    def headers(self, admin_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {admin_key}", "accept": "application/json"}

    def params(self, first_day: date, end: date, limit: int,
               project_ids: tuple[str, ...]) -> list[tuple[str, str]]:
        return [("start_time", str(unix_s(first_day))), ("end_time", str(unix_s(end))),
                ("bucket_width", "1d"), ("limit", str(limit)),
                *(("project_ids", p) for p in project_ids)]

    def project_ids(self, env: Mapping[str, str]) -> tuple[str, ...]:
        raw = env.get(self.projects_setting, "")
        projects = tuple(p.strip() for p in raw.split(",") if p.strip())
        if len(projects) > PROJECTS_MAX or not all(_PROJECT_ID.fullmatch(p) for p in projects):
            raise ConfigError(f"{self.projects_setting} must be OpenAI project ids (proj_...), "
                              f"comma-separated, at most {PROJECTS_MAX}")
        return projects

    def bucket(self, bucket: object) -> tuple[date, list[Any]]:
        provider = self.provider
        if not isinstance(bucket, dict):
            raise failed(provider, "malformed", "a bucket is not an object")
        start_s, end_s, results = (bucket.get("start_time"), bucket.get("end_time"),
                                   bucket.get("results"))
        if type(start_s) is not int or type(end_s) is not int or not isinstance(results, list):
            raise failed(provider, "malformed",
                         "a bucket without integer start_time, end_time and a results list")
        if not 0 <= start_s < end_s <= INT_EXACT_MAX:
            raise failed(provider, "malformed", "a bucket's times are out of range")
        return bucket_day(provider, datetime.fromtimestamp(start_s, UTC),
                          datetime.fromtimestamp(end_s, UTC)), results

    def result_micros(self, result: object, day: date) -> Decimal:
        amount = result.get("amount") if isinstance(result, dict) else None
        if not isinstance(amount, dict):
            raise failed(self.provider, "malformed", f"a result of {day} has no amount")
        check_usd(self.provider, amount.get("currency"))
        value = amount.get("value")
        if isinstance(value, bool) or not isinstance(value, int | Decimal):
            raise failed(self.provider, "malformed", f"an amount of {day} is not a number")
        return Decimal(value) * MICROS_PER_USD


class AnthropicCosts(CostReport):
    """Anthropic's `GET /v1/organizations/cost_report`: `{"data": [{"starting_at", "ending_at",
    "results": [{"currency": "USD", "amount": "<cents, a decimal string>", ...}]}], "has_more",
    "next_page"}`, Priority Tier costs not in it."""

    provider = Upstream.ANTHROPIC
    key_setting = "CEILING_ANTHROPIC_ADMIN_KEY"
    url_setting = "CEILING_ANTHROPIC_ADMIN_URL"
    url_default = "https://api.anthropic.com"
    path = "/v1/organizations/cost_report"
    buckets_per_page_max = 31
    # The Admin API version the report's format above is documented for.
    version = "2023-06-01"

    def headers(self, admin_key: str) -> dict[str, str]:
        return {"x-api-key": admin_key, "anthropic-version": self.version,
                "accept": "application/json"}

    def params(self, first_day: date, end: date, limit: int,
               project_ids: tuple[str, ...]) -> list[tuple[str, str]]:
        return [("starting_at", rfc3339(first_day)), ("ending_at", rfc3339(end)),
                ("bucket_width", "1d"), ("limit", str(limit))]

    def bucket(self, bucket: object) -> tuple[date, list[Any]]:
        provider = self.provider
        if not isinstance(bucket, dict) or not isinstance(bucket.get("results"), list):
            raise failed(provider, "malformed", "a bucket without a results list")
        return bucket_day(provider, instant(provider, bucket.get("starting_at")),
                          instant(provider, bucket.get("ending_at"))), bucket["results"]

    def result_micros(self, result: object, day: date) -> Decimal:
        if not isinstance(result, dict):
            raise failed(self.provider, "malformed", f"a result of {day} is not an object")
        check_usd(self.provider, result.get("currency"))
        cents = result.get("amount")
        # A string, as documented: a JSON number here would be a format this does not know.
        if not isinstance(cents, str) or not _DECIMAL.fullmatch(cents):
            raise failed(self.provider, "malformed",
                         f"an amount of {day} is not a decimal string of cents")
        return Decimal(cents) * MICROS_PER_CENT


# The cost report of each provider reconciliation can read, by its name (`ceiling reconcile
# <name>`, the admin route's `provider`), in the order the schedule reads them.
COST_REPORTS: dict[Upstream, CostReport] = {
    report.provider: report for report in (OpenAICosts(), AnthropicCosts())}


# -- where a report is read from ------------------------------------------------------------------


def configured(provider: Upstream, env: Mapping[str, str]) -> bool:
    """Whether an admin key is set for `provider`'s cost report."""
    return bool(env.get(COST_REPORTS[provider].key_setting, "").strip())


@dataclass(frozen=True)
class ReportSource:
    """A provider's cost report as configured: its base URL, the admin key it is read with, and
    the projects it is narrowed to (none: the whole organisation)."""

    provider: Upstream
    base_url: str
    admin_key: str
    project_ids: tuple[str, ...] = ()

    @property
    def report(self) -> CostReport:
        return COST_REPORTS[self.provider]

    @property
    def url(self) -> str:
        return self.base_url + self.report.path

    def headers(self) -> dict[str, str]:
        return self.report.headers(self.admin_key)

    def params(self, first_day: date, last_day: date) -> list[tuple[str, str]]:
        """The query of the first page; later pages add `page`."""
        days = (last_day - first_day).days + 1
        report = self.report
        return report.params(first_day, last_day + ONE_DAY,
                             min(days, report.buckets_per_page_max), self.project_ids)

    @classmethod
    def from_env(cls, provider: Upstream, env: Mapping[str, str]) -> ReportSource:
        """The report's admin key and base URL from the variables its CostReport names (and
        its projects, where it takes them). ConfigError without a key."""
        report = COST_REPORTS[provider]
        key_var, url_var, default = report.key_setting, report.url_setting, report.url_default
        key = env.get(key_var, "").strip()
        if not key:
            raise ConfigError(f"{key_var} is not set: reconciling with {provider}'s cost report "
                              "reads it with an admin key")
        url = (env.get(url_var, "").strip() or default).rstrip("/")
        if not url.startswith(("https://", "http://")):
            raise ConfigError(f"{url_var} must be an http(s) URL, such as {default}")
        if url.endswith("/v1"):
            raise ConfigError(f"{url_var} is the base URL without /v1, such as {default}")
        return cls(provider, url, key, report.project_ids(env))

def _error_message(body: bytes) -> str:
    """A provider's error message (both put it at error.message), else the start of the body."""
    try:
        doc = json.loads(body)
        message = doc["error"]["message"]
        if isinstance(message, str):
            return message[:REPORT_ERROR_CHARS_MAX]
    except (ValueError, TypeError, KeyError, RecursionError):
        pass
    return body[:REPORT_ERROR_CHARS_MAX].decode(errors="replace")


def whole_micros(provider: Upstream, exact: Decimal) -> int:
    """Exact micro-dollars rounded half up to whole ones; an amount no ledger could hold is not
    a cost report."""
    try:
        micros = int(exact.to_integral_value(rounding=ROUND_HALF_UP))
    except (InvalidOperation, OverflowError) as exc:
        raise failed(provider, "malformed", "an amount out of range") from exc
    if abs(micros) > INT_EXACT_MAX:
        raise failed(provider, "malformed", "an amount out of range")
    return micros


async def provider_spend_by_day(source: ReportSource, first_day: date, last_day: date,
                                fetch: Fetch) -> dict[date, int]:
    """What the provider's report says it billed, in micro-dollars, for each day in
    [first_day, last_day] that it has a bucket for, every page read."""
    provider = source.provider
    parse = source.report.parse_page
    base = source.params(first_day, last_day)
    exact: dict[date, Decimal] = {}
    seen: set[str] = set()
    page: str | None = None
    for _ in range(REPORT_PAGES_MAX):
        status, body = await fetch(source.url, [*base, *([("page", page)] if page else [])],
                                   source.headers())
        if status != 200:
            # A provider may quote the key it refused: the admin key never goes further.
            message = _error_message(body).replace(source.admin_key, "<admin key>")
            raise failed(provider, "http_status", f"HTTP {status}: {message}", status=status)
        found = parse(body)
        for day, micros in found.micros_by_day.items():
            # Days outside the range asked for are not this reconciliation's.
            if first_day <= day <= last_day:
                exact[day] = exact.get(day, Decimal(0)) + micros
        if not found.has_more:
            return {day: whole_micros(provider, micros) for day, micros in exact.items()}
        if found.next_page in seen:
            raise failed(provider, "malformed", "a page names itself as the next page again")
        page = found.next_page
        seen.add(page or "")
    raise failed(provider, "pages", f"still more pages after {REPORT_PAGES_MAX}")


# -- comparing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DayDrift:
    day: date
    ledger_micros: int
    provider_micros: int
    within: bool
    # With `book_into`: what is booked for the day so far, and what this run booked of it.
    booked_micros: int = 0
    booked_now_micros: int = 0
    # What the ledger counted that day for sidecar reservations of an amount, which name no
    # provider (Upstream.UNATTRIBUTED): it may be on this provider's bill, so it is taken off
    # what is booked (`unseen_micros`), never booked again.
    unattributed_micros: int = 0

    @property
    def drift_micros(self) -> int:
        return self.provider_micros - self.ledger_micros

    @property
    def drift_pct(self) -> Decimal:
        base = max(abs(self.provider_micros), abs(self.ledger_micros))
        if not base:
            return Decimal(0)
        return (Decimal(abs(self.drift_micros)) * 100 / base).quantize(
            DRIFT_PCT_PLACES, rounding=ROUND_HALF_UP)

    @property
    def unseen_micros(self) -> int:
        """What is to be booked for the day (module docstring): beyond the tolerance, all that
        the provider billed beyond what the ledger saw, less the day's unattributed spend;
        otherwise nothing."""
        return 0 if self.within else max(0, self.drift_micros - self.unattributed_micros)

    def json(self, booking: bool = False) -> dict[str, Any]:
        found = {"day": self.day.isoformat(), "ledger_micros": self.ledger_micros,
                 "provider_micros": self.provider_micros, "drift_micros": self.drift_micros,
                 "drift_pct": float(self.drift_pct), "within": self.within}
        if self.unattributed_micros:
            found["unattributed_micros"] = self.unattributed_micros
        if booking:
            found.update(booked_micros=self.booked_micros,
                         booked_now_micros=self.booked_now_micros)
        return found


def within(ledger_micros: int, provider_micros: int, tolerance_pct: Decimal) -> bool:
    """|provider - ledger| <= tolerance_pct% of the larger of the two, exactly."""
    base = max(abs(provider_micros), abs(ledger_micros))
    return abs(provider_micros - ledger_micros) * 100 <= tolerance_pct * base


@dataclass(frozen=True)
class Reconciled:
    provider: Upstream
    tolerance_pct: Decimal
    days: tuple[DayDrift, ...]
    book_into: str | None = None  # the budget unseen spend was booked into, if any
    # Another run held the provider's booking lease (BOOKING_LEASE_MS): this one booked nothing.
    booking_held: bool = False

    @property
    def within(self) -> bool:
        return all(d.within for d in self.days)

    @property
    def beyond(self) -> tuple[DayDrift, ...]:
        return tuple(d for d in self.days if not d.within)

    @property
    def booked_now_micros(self) -> int:
        return sum(d.booked_now_micros for d in self.days)

    def json(self) -> dict[str, Any]:
        booking = self.book_into is not None
        found = {"provider": str(self.provider), "tolerance_pct": float(self.tolerance_pct),
                 "days": [d.json(booking) for d in self.days], "within": self.within}
        if booking:
            found.update(book_into=self.book_into, booked_now_micros=self.booked_now_micros)
        if self.booking_held:
            found["booking_held"] = True
        return found

    def lines(self) -> list[str]:
        """The per-day table `ceiling reconcile` prints, then its verdict."""
        rows = [f"{self.provider}: ledger vs cost report, tolerance {self.tolerance_pct}%",
                f"{'day':<10}  {'ledger $':>14}  {'provider $':>14}  {'drift $':>15}  "
                f"{'drift %':>9}"]
        for d in self.days:
            sign = "+" if d.drift_micros > 0 else ""
            rows.append(f"{d.day.isoformat():<10}  {micros_to_usd(d.ledger_micros):>14}  "
                        f"{micros_to_usd(d.provider_micros):>14}  "
                        f"{sign + micros_to_usd(d.drift_micros):>15}  {d.drift_pct:>8.2f}%"
                        + ("" if d.within else "  BEYOND"))
        if self.within:
            rows.append(f"within tolerance: all {len(self.days)} days")
        else:
            rows.extend(
                f"beyond tolerance: {d.day.isoformat()} drift "
                f"{'+' if d.drift_micros > 0 else ''}${micros_to_usd(d.drift_micros)} "
                f"({d.drift_pct:.2f}%)" for d in self.beyond)
        if self.book_into is not None:
            rows.extend(
                f"booked into {self.book_into}: {d.day.isoformat()} "
                f"${micros_to_usd(d.booked_now_micros)} now, "
                f"${micros_to_usd(d.booked_micros)} in all" for d in self.days if d.booked_micros)
            rows.append(f"booked into {self.book_into} by this run: "
                        f"${micros_to_usd(self.booked_now_micros)}")
        rows.extend(f"unattributed on {d.day.isoformat()}: ${micros_to_usd(d.unattributed_micros)}"
                    " (sidecar amounts, taken off what is booked)"
                    for d in self.days if d.unattributed_micros)
        if self.booking_held:
            rows.append(f"booked nothing: another run is booking {self.provider}'s unseen spend")
        return rows


def compare(provider: Upstream, ledger: Mapping[date, int], report: Mapping[date, int],
            first_day: date, last_day: date, tolerance_pct: Decimal,
            unattributed: Mapping[date, int] | None = None) -> Reconciled:
    """Every day of the range, in order; a day absent from either side is a zero there."""
    days = []
    day = first_day
    while day <= last_day:
        ledger_micros, provider_micros = ledger.get(day, 0), report.get(day, 0)
        days.append(DayDrift(day, ledger_micros, provider_micros,
                             within(ledger_micros, provider_micros, tolerance_pct),
                             unattributed_micros=(unattributed or {}).get(day, 0)))
        day += ONE_DAY
    return Reconciled(provider, tolerance_pct, tuple(days))


# -- what the caller gives ------------------------------------------------------------------------


def provider_of(text: str | None) -> Upstream:
    """The provider whose cost report `text` names (COST_REPORTS)."""
    for provider in COST_REPORTS:
        if text == provider:
            return provider
    names = " or ".join(f"'{provider}'" for provider in COST_REPORTS)
    raise InvalidRequest(f"provider must be {names}", field="provider")


def tolerance_of(text: str | None) -> Decimal:
    """A percentage from 0 to 100 (a decimal); the default when none is given."""
    if text is None or text == "":
        return TOLERANCE_PCT_DEFAULT
    try:
        value = Decimal(text) if len(text) <= 20 else Decimal("NaN")
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or not 0 <= value <= 100:
        raise InvalidRequest("tolerance_pct must be a number from 0 to 100",
                             field="tolerance_pct")
    return value


def _day_of(text: str, field: str) -> date:
    if not _DAY.fullmatch(text):
        raise InvalidRequest(f"{field} must be a day, YYYY-MM-DD", field=field)
    try:
        return date.fromisoformat(text)
    except ValueError as exc:
        raise InvalidRequest(f"{field} must be a day, YYYY-MM-DD", field=field) from exc


def day_range(first: str | None, last: str | None, today: date) -> tuple[date, date]:
    """[from, to], both UTC days: by default the RECONCILE_DAYS_DEFAULT days up to yesterday;
    `from` alone runs to yesterday, `to` alone reaches back the default length. No day after
    today, no more than RECONCILE_DAYS_MAX days, none the ledger no longer keeps."""
    last_day = today - ONE_DAY if last is None else _day_of(last, "to")
    first_day = (last_day - timedelta(days=RECONCILE_DAYS_DEFAULT - 1) if first is None
                 else _day_of(first, "from"))
    if first_day > today:
        raise InvalidRequest(f"from is after today ({today.isoformat()}, UTC)", field="from")
    if first is not None and last is None and first_day > last_day:
        last_day = first_day  # `from` today, alone: today
    if last_day > today:
        raise InvalidRequest(f"to is after today ({today.isoformat()}, UTC)", field="to")
    if first_day > last_day:
        raise InvalidRequest("from is after to", field="from")
    if (last_day - first_day).days + 1 > RECONCILE_DAYS_MAX:
        raise InvalidRequest(f"at most {RECONCILE_DAYS_MAX} days at once", field="from")
    if (today - first_day).days >= RECONCILE_DAYS_MAX:
        raise InvalidRequest(f"the ledger keeps a day's gateway spend {RECONCILE_DAYS_MAX} days",
                             field="from")
    return first_day, last_day


def book_into_of(text: str | None) -> BudgetId | None:
    """The budget unseen spend is booked into: an operator's budget id (no scope of a reserved
    kind: a run's, an end user's, a model's counters are the ledger's own), or None."""
    if text is None or text == "":
        return None
    try:
        return BudgetId.operator(text)
    except InvalidRequest as exc:
        raise InvalidRequest(f"book_into: {exc.message}", field="book_into") from exc


# The budget the scheduled run (api/routes/reconcile.py reconcile_configured) books unseen spend
# into; unset: it books nothing.
BOOK_INTO_SETTING = "CEILING_RECONCILE_BOOK_INTO"


def scheduled_book_into(env: Mapping[str, str]) -> BudgetId | None:
    """BOOK_INTO_SETTING's budget id, or None; ConfigError naming the setting if it is not an
    operator's budget id."""
    try:
        return book_into_of(env.get(BOOK_INTO_SETTING, "").strip())
    except InvalidRequest as exc:
        raise ConfigError(f"{BOOK_INTO_SETTING}: {exc.message}") from exc


def today_of(now_ms: int) -> date:
    return datetime.fromtimestamp(now_ms / 1000, UTC).date()


# -- the whole of it ------------------------------------------------------------------------------


class ReconcileStore(Reconciliation, BudgetCatalogue, Protocol):
    """What a reconciliation reads and writes: the ledger's days, and the budget it books into."""


@dataclass(frozen=True)
class Booking:
    """Book unseen spend into `budget_id`; each booking is audited as made `by` (an operator's
    fingerprint, the CLI's user, the schedule) unless not `audited`."""

    budget_id: BudgetId
    by: str
    audited: bool = True


async def _book(store: ReconcileStore, booking: Booking, result: Reconciled, first_day: date,
                last_day: date) -> Reconciled:
    """Book each day's unseen spend, holding the provider's booking lease: a run that finds it
    held books nothing and says so (`booking_held`)."""
    provider, budget_id = result.provider, booking.budget_id
    token = secrets.token_hex(16)
    if not await store.take_booking_lease(provider, token, BOOKING_LEASE_MS):
        return replace(result, book_into=budget_id.path, booking_held=True)
    try:
        return await _book_held(store, booking, result, first_day, last_day)
    finally:
        await store.end_booking_lease(provider, token)


async def _book_held(store: ReconcileStore, booking: Booking, result: Reconciled,
                     first_day: date, last_day: date) -> Reconciled:
    provider, budget_id = result.provider, booking.budget_id
    tag = budget_id.tag
    # What is booked for a day in any organisation counts as booked here: an operator who names a
    # budget of another organisation later does not book the day again. Read once, under the
    # lease, so no run books between this read and this run's bookings.
    everywhere = await store.unseen_booked_by_day(provider, first_day, last_day)
    here = await store.unseen_booked_by_day(provider, first_day, last_day, tag)
    days = []
    for d in result.days:
        mine = here.get(d.day, 0)
        elsewhere = everywhere.get(d.day, 0) - mine
        now_micros = 0
        # A day booked as far as its unseen spend goes has nothing new: no step to run.
        if d.unseen_micros - elsewhere > mine:
            done = await store.book_unseen(budget_id, provider, d.day, d.unseen_micros - elsewhere)
            mine, now_micros = done.booked_micros, done.booked_now_micros
        days.append(replace(d, booked_micros=mine + elsewhere, booked_now_micros=now_micros))
    if booking.audited:
        await _audit(store, booking, provider, days)
    return replace(result, days=tuple(days), book_into=budget_id.path)


async def _audit(store: ReconcileStore, booking: Booking, provider: Upstream,
                 days: Sequence[DayDrift]) -> None:
    """An audit entry for each day whose booked total in the booking's organisation is above
    the one audited: this run's bookings, and any a run that died before its entry left
    (lua/audit_booked.lua: once per total)."""
    tag = booking.budget_id.tag
    here = await store.unseen_booked_by_day(provider, days[0].day, days[-1].day, tag) if (
        days) else {}
    audited = await store.unseen_audited(tag, provider, [d for d in here])
    for d in days:
        total, was = here.get(d.day, 0), audited.get(d.day, 0)
        if total <= was:
            continue
        event_id = event_id_of(UNSEEN_BOOKED, provider.value, d.day.isoformat(), str(total))
        await store.audit_unseen_booked(
            tag, provider, d.day, was, total, audit_fields(
                booking.by, UNSEEN_BOOKED, booking.budget_id.path,
                {"provider": str(provider), "day": d.day.isoformat(),
                 "booked_micros": total - was, "booked_total_micros": total,
                 "ledger_micros": d.ledger_micros, "provider_micros": d.provider_micros,
                 "event_id": event_id}), AUDIT_RETENTION_MS)


async def reconcile(store: ReconcileStore, source: ReportSource, first: str | None,
                    last: str | None, tolerance_pct: Decimal, fetch: Fetch,
                    booking: Booking | None = None) -> Reconciled:
    """Compare the ledger's gateway spend with the provider's report over the days asked (the
    ledger's clock says which day is today), and put a `ledger.drift` event in the alert
    outbox for each day beyond the tolerance (once per provider and day, ever). With a
    `booking`, book each day's unseen spend into its budget (module docstring); the budget must
    exist, checked before the report is read, so a wrong name books nothing and says so."""
    first_day, last_day = day_range(first, last, today_of(await store.ledger_time_ms()))
    if booking is not None and await store.get_budget(booking.budget_id) is None:
        raise BudgetNotFound(f"book_into: no budget {booking.budget_id.path}",
                             budget_id=booking.budget_id.path, field="book_into")
    report = await provider_spend_by_day(source, first_day, last_day, fetch)
    ledger = await store.gateway_spend_by_day(source.provider, first_day, last_day)
    unattributed = await store.gateway_spend_by_day(Upstream.UNATTRIBUTED, first_day, last_day)
    result = compare(source.provider, ledger, report, first_day, last_day, tolerance_pct,
                     unattributed)
    for d in result.beyond:
        await store.emit_drift_alert(DriftEvent(source.provider, d.day, d.ledger_micros,
                                                d.provider_micros))
    if booking is None:
        return result
    return await _book(store, booking, result, first_day, last_day)
