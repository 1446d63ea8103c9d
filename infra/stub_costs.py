"""The stub provider's cost reports: what it billed, per UTC day, in each provider's documented
format, as an admin key reads it.

The witness for reconciliation (core/reconcile.py) must be the stub's own bill, never the
service's numbers nor its price table: every call the stub bills is added here, at its cost
and on the UTC day the stub billed it (its own clock), and the reports are built from that book
alone. Like the bill, nothing here imports `core`.

  GET /v1/organization/costs         OpenAI's: `start_time` (unix seconds, inclusive), `end_time`
                                     (exclusive, default now), `bucket_width=1d`, `limit` (1-180,
                                     default 7), `page`, `project_ids` (repeated); daily buckets
                                     whose `amount.value` is a JSON number in DOLLARS, currency
                                     "usd". Auth: `Authorization: Bearer <admin key>`.
  GET /v1/organizations/cost_report  Anthropic's: `starting_at` (RFC 3339, inclusive),
                                     `ending_at` (buckets that end by it, default now),
                                     `bucket_width=1d`, `limit` (1-31, default 7), `page`; daily
                                     buckets whose `amount` is a decimal STRING of CENTS, currency
                                     "USD"; Priority Tier calls are not in it. Auth: `x-api-key:
                                     <admin key>` and an `anthropic-version` header.
  GET, POST /costs/control           how the next reports are made (below); a POST replaces them.

Both page through `has_more` / `next_page` (an opaque token). A day without spend is a bucket
with no results. Reports follow `/control`'s settings: `scale` (a decimal string, "1"): every
amount is the bill times it, a report that disagrees with the bill; `mode`: "ok", "error" (HTTP
500 in the provider's error shape), "non_usd" (amounts in euros), "malformed" (OpenAI's amount
as a string, Anthropic's as a number); `buckets_per_page_max` (none): pages shorter than the
`limit` asked, so that a range takes several pages; `billed_elsewhere` (none): a list of
`{"provider", "day": "YYYY-MM-DD", "cost_micros"}`, spend the provider billed on a day that no
call to this stub carried (its key used from elsewhere, its console), added to that day's bill:
the only way a report can show a day before the stub started.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infra.processes import tls_context

# Which provider's report a call's cost goes in, by the API that billed it (CallRecord.api).
PROVIDER_OF_API = {"chat.completions": "openai", "responses": "openai", "messages": "anthropic",
                   "embeddings": "openai"}
# Anthropic's cost report leaves out Priority Tier costs, as its documentation says.
ANTHROPIC_UNREPORTED_TIERS = frozenset({"priority"})
MICROS_PER_USD = 1_000_000
MICROS_PER_CENT = 10_000
ONE_DAY = timedelta(days=1)
# `limit` as each provider documents it for daily buckets: (default, most).
OPENAI_LIMIT = (7, 180)
ANTHROPIC_LIMIT = (7, 31)
MODES = ("ok", "error", "non_usd", "malformed")
# The project the stub bills every OpenAI call under: a `project_ids` filter without it finds
# nothing.
STUB_PROJECT_ID = "proj_stub"
# A report reaches back no further than this many days: a stub, not an archive.
REPORT_DAYS_MAX = 1_000
CONTROL_TIMEOUT_S = 10.0


@dataclass
class CostBook:
    """The stub's bill per provider and UTC day, in micro-dollars."""

    micros: dict[tuple[str, date], int] = field(default_factory=dict)

    def record(self, api: str, service_tier: str | None, cost_micros: int, at_s: float) -> None:
        provider = PROVIDER_OF_API.get(api)
        if provider is None or not cost_micros:
            return
        if provider == "anthropic" and service_tier in ANTHROPIC_UNREPORTED_TIERS:
            return
        day = datetime.fromtimestamp(at_s, UTC).date()
        self.micros[(provider, day)] = self.micros.get((provider, day), 0) + cost_micros

    def of(self, provider: str, day: date) -> int:
        return self.micros.get((provider, day), 0)


def _elsewhere(raw: object) -> tuple[tuple[str, date, int], ...]:
    """`billed_elsewhere` as (provider, day, cost_micros) entries."""
    if not isinstance(raw, list):
        raise ValueError("billed_elsewhere is a list")
    out = []
    for entry in raw:
        if not isinstance(entry, dict) or set(entry) != {"provider", "day", "cost_micros"} \
                or entry["provider"] not in set(PROVIDER_OF_API.values()) \
                or type(entry["cost_micros"]) is not int or entry["cost_micros"] < 0 \
                or not isinstance(entry["day"], str):
            raise ValueError("billed_elsewhere entries are {provider, day, cost_micros}")
        out.append((entry["provider"], date.fromisoformat(entry["day"]), entry["cost_micros"]))
    return tuple(out)


@dataclass(frozen=True)
class CostSettings:
    scale: Decimal = Decimal(1)
    mode: str = "ok"
    buckets_per_page_max: int | None = None
    billed_elsewhere: tuple[tuple[str, date, int], ...] = ()

    @classmethod
    def from_json(cls, doc: object) -> CostSettings:
        fields = {"scale", "mode", "buckets_per_page_max", "billed_elsewhere"}
        if not isinstance(doc, dict) or set(doc) - fields:
            raise ValueError("cost control takes scale, mode, buckets_per_page_max and "
                             "billed_elsewhere")
        try:
            scale = Decimal(str(doc.get("scale", "1")))
        except InvalidOperation as exc:
            raise ValueError("scale is a decimal string") from exc
        mode = doc.get("mode", "ok")
        per_page = doc.get("buckets_per_page_max")
        if not scale.is_finite() or scale < 0 or mode not in MODES or not (
                per_page is None or (type(per_page) is int and per_page >= 1)):
            raise ValueError(f"scale >= 0, mode one of {MODES}, buckets_per_page_max >= 1")
        return cls(scale, mode, per_page, _elsewhere(doc.get("billed_elsewhere", [])))

    def to_json(self) -> dict[str, Any]:
        return {"scale": str(self.scale), "mode": self.mode,
                "buckets_per_page_max": self.buckets_per_page_max,
                "billed_elsewhere": [{"provider": p, "day": d.isoformat(), "cost_micros": c}
                                     for p, d, c in self.billed_elsewhere]}


class BadQuery(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _page_token(day: date) -> str:
    return "page_" + base64.urlsafe_b64encode(day.isoformat().encode()).decode()


def _page_day(token: str) -> date:
    try:
        return date.fromisoformat(base64.urlsafe_b64decode(token.removeprefix("page_")).decode())
    except (ValueError, binascii.Error) as exc:
        raise BadQuery(400, "page is not a token this report gave") from exc


def _limit(raw: str | None, bounds: tuple[int, int]) -> int:
    default, most = bounds
    if raw is None:
        return default
    if not re.fullmatch(r"[0-9]{1,4}", raw) or not 1 <= int(raw) <= most:
        raise BadQuery(400, f"limit must be from 1 to {most}")
    return int(raw)


def _instant(raw: str, name: str) -> datetime:
    try:
        found = datetime.fromisoformat(raw)
    except ValueError as exc:
        raise BadQuery(400, f"{name} is not an RFC 3339 time") from exc
    if found.tzinfo is None:
        raise BadQuery(400, f"{name} has no UTC offset")
    return found.astimezone(UTC)


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


class CostReports:
    """The two reports over one book, and their settings."""

    def __init__(self, admin_key: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.admin_key = admin_key
        self.clock = clock
        self.book = CostBook()
        self.settings = CostSettings()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/organization/costs", self.openai, methods=["GET"]),
            Route("/v1/organizations/cost_report", self.anthropic, methods=["GET"]),
            Route("/costs/control", self.control, methods=["GET", "POST"]),
        ]

    def reset(self) -> None:
        self.book = CostBook()

    async def control(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                self.settings = CostSettings.from_json(await request.json())
            except ValueError as exc:
                return JSONResponse({"error": {"message": f"cost control: {exc}"}},
                                    status_code=400)
        return JSONResponse(self.settings.to_json())

    def _scaled(self, provider: str, day: date, per_unit: int) -> Decimal:
        """The day's bill times the scale, in dollars (per_unit: micros a dollar) or cents."""
        elsewhere = sum(c for p, d, c in self.settings.billed_elsewhere
                        if (p, d) == (provider, day))
        return (Decimal(self.book.of(provider, day) + elsewhere) * self.settings.scale
                / per_unit)

    def _days(self, first: date, end: datetime, token: str | None, limit: int
              ) -> tuple[list[date], str | None]:
        """One page of the days from `first` whose bucket ends by `end`, from the page's day."""
        start = first if token is None else _page_day(token)
        per_page = min(limit, self.settings.buckets_per_page_max or limit)
        days: list[date] = []
        day = start
        while _midnight(day + ONE_DAY) <= end and len(days) < per_page:
            days.append(day)
            day += ONE_DAY
        more = _midnight(day + ONE_DAY) <= end
        return days, _page_token(day) if more else None

    # -- OpenAI ----------------------------------------------------------------------------------

    async def openai(self, request: Request) -> Response:
        if self.admin_key is not None and request.headers.get(
                "authorization") != f"Bearer {self.admin_key}":
            return self._openai_error(401, "Incorrect API key provided", "invalid_request_error")
        try:
            q = request.query_params
            if q.get("bucket_width", "1d") != "1d":
                raise BadQuery(400, "bucket_width must be 1d")
            start_s = q.get("start_time")
            if start_s is None or not re.fullmatch(r"[0-9]{1,12}", start_s):
                raise BadQuery(400, "start_time (unix seconds) is required")
            end_raw = q.get("end_time")
            if end_raw is not None and not re.fullmatch(r"[0-9]{1,12}", end_raw):
                raise BadQuery(400, "end_time is unix seconds")
            first = datetime.fromtimestamp(int(start_s), UTC).date()
            end_s = int(end_raw) if end_raw is not None else self.clock()
            # The current day's bucket is shown whole, as a bucket ending at the next midnight.
            end = _midnight(datetime.fromtimestamp(end_s - 1, UTC).date() + ONE_DAY)
            self._bounded(first, end)
            days, next_page = self._days(first, end, q.get("page"),
                                         _limit(q.get("limit"), OPENAI_LIMIT))
        except BadQuery as exc:
            return self._openai_error(exc.status, exc.message, "invalid_request_error")
        if self.settings.mode == "error":
            return self._openai_error(500, "The server had an error processing your request",
                                      "server_error")
        projects = q.getlist("project_ids")
        counted = not projects or STUB_PROJECT_ID in projects
        buckets = []
        for day in days:
            dollars = self._scaled("openai", day, MICROS_PER_USD) if counted else Decimal(0)
            results = [] if not dollars else [{
                "object": "organization.costs.result",
                "amount": {"value": str(dollars) if self.settings.mode == "malformed"
                           else float(dollars),
                           "currency": "eur" if self.settings.mode == "non_usd" else "usd"},
                "line_item": None, "project_id": None}]
            start = int(_midnight(day).timestamp())
            buckets.append({"object": "bucket", "start_time": start,
                            "end_time": start + int(ONE_DAY.total_seconds()),
                            "results": results})
        return JSONResponse({"object": "page", "data": buckets,
                             "has_more": next_page is not None, "next_page": next_page})

    @staticmethod
    def _openai_error(status: int, message: str, kind: str) -> Response:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                       "code": None}}, status_code=status)

    # -- Anthropic -------------------------------------------------------------------------------

    async def anthropic(self, request: Request) -> Response:
        if self.admin_key is not None and request.headers.get("x-api-key") != self.admin_key:
            return self._anthropic_error(401, "invalid x-api-key", "authentication_error")
        if not request.headers.get("anthropic-version"):
            return self._anthropic_error(400, "anthropic-version: header is required",
                                         "invalid_request_error")
        try:
            q = request.query_params
            if q.get("bucket_width", "1d") != "1d":
                raise BadQuery(400, "bucket_width must be 1d")
            starting = q.get("starting_at")
            if starting is None:
                raise BadQuery(400, "starting_at is required")
            # Buckets are snapped to the start of their UTC day.
            first = _instant(starting, "starting_at").date()
            ending = q.get("ending_at")
            end = (_instant(ending, "ending_at") if ending is not None
                   else _midnight(datetime.fromtimestamp(self.clock(), UTC).date() + ONE_DAY))
            self._bounded(first, end)
            days, next_page = self._days(first, end, q.get("page"),
                                         _limit(q.get("limit"), ANTHROPIC_LIMIT))
        except BadQuery as exc:
            return self._anthropic_error(exc.status, exc.message, "invalid_request_error")
        if self.settings.mode == "error":
            return self._anthropic_error(500, "Internal server error", "api_error")
        buckets = []
        for day in days:
            cents = self._scaled("anthropic", day, MICROS_PER_CENT)
            results = [] if not cents else [{
                "currency": "EUR" if self.settings.mode == "non_usd" else "USD",
                "amount": float(cents) if self.settings.mode == "malformed"
                else format(cents, "f"),
                "workspace_id": None, "description": None, "cost_type": None,
                "context_window": None, "model": None, "service_tier": None,
                "token_type": None}]
            buckets.append({"starting_at": _rfc3339(_midnight(day)),
                            "ending_at": _rfc3339(_midnight(day + ONE_DAY)),
                            "results": results})
        return JSONResponse({"data": buckets, "has_more": next_page is not None,
                             "next_page": next_page})

    @staticmethod
    def _anthropic_error(status: int, message: str, kind: str) -> Response:
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                            status_code=status)

    @staticmethod
    def _bounded(first: date, end: datetime) -> None:
        if end <= _midnight(first) or (end - _midnight(first)).days > REPORT_DAYS_MAX:
            raise BadQuery(400, f"the range must be from one to {REPORT_DAYS_MAX} days")


def _rfc3339(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def cost_control(provider_url: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Set how the stub's next cost reports are made (a POST replaces every setting)."""
    answer = httpx.post(f"{provider_url}/costs/control", json=settings,
                        timeout=CONTROL_TIMEOUT_S, verify=tls_context())
    answer.raise_for_status()
    found = answer.json()
    assert isinstance(found, dict)
    return found

