"""Alerts: what a budget alerts on, the events the ledger emits, and how they go out.

The ledger decides every event inside the step that moves the money (lua/lib.lua, "Alerts"),
and writes it to the tag's outbox. Delivery (`deliver_due`)
takes due events from every tag's outbox, posts each as JSON signed with HMAC-SHA256, retries a
failure with backoff, and records the outcome; it runs in a long-running instance's background
task and from a scheduler's POST /v1/admin/alerts/deliver, never on a call's path. The sender
is given (api/alerts.py): core imports no HTTP client.

A receiver deduplicates on `event_id`: one event is emitted once per (budget, period window,
threshold), or once per (provider, day) for a `ledger.drift`, and posted again only when a
deliverer died between its post and its record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from core.errors import InvalidRequest
from core.limits import (
    ALERT_THRESHOLDS_MAX,
    VELOCITY_MULTIPLE_MILLI_MAX,
    VELOCITY_WINDOW_S_MAX,
    VELOCITY_WINDOW_S_MIN,
)

if TYPE_CHECKING:  # core.ledger imports this module's AlertEvent
    from core.ledger import AlertOutbox

THRESHOLDS_PCT_DEFAULT = (50, 80, 100)
# Event types, as the body names them.
THRESHOLD_CROSSED = "budget.threshold_crossed"
EXCEEDED = "budget.exceeded"
VELOCITY = "budget.velocity"
# The ledger's gateway spend of a day and a provider's cost report disagree beyond the tolerance
# (core/reconcile.py): an event about the ledger, under no budget.
DRIFT = "ledger.drift"
# Spend a provider's cost report shows beyond what the ledger saw, booked into a budget
# (core/reconcile.py, `book_into`): an event of that budget's tag, once per amount reached.
UNSEEN_BOOKED = "ledger.unseen_booked"
SIGNATURE_HEADER = "x-ceiling-signature"
# Attempts of one event before it is given up on and shown as failed: with ALERT_BACKOFF_MS the
# last is some 40 minutes after the first, past a receiver's deploy or restart.
DELIVERY_ATTEMPTS_MAX = 6
# Wait before attempt n+1 (ms), doubling: 30 s, 1 min, 2 min, 4 min, 8 min, then the cap.
ALERT_BACKOFF_MS_FIRST = 30_000
ALERT_BACKOFF_MS_MAX = 30 * 60_000
# A deliverer holds the events it took this long before another may take them: longer than one
# post's timeout (ALERT_POST_TIMEOUT_S) times a batch posted one after another.
ALERT_CLAIM_LEASE_MS = 120_000
ALERT_POST_TIMEOUT_S = 5.0
# Events one delivery pass takes per tag: a pass stays short; the next one takes the rest.
ALERT_BATCH_MAX = 20
# The error text kept with a failed attempt: enough to read the cause, bounded.
ALERT_ERROR_CHARS_MAX = 300
SLACK_HOSTS = ("hooks.slack.com",)


@dataclass(frozen=True)
class VelocityAlarm:
    """Spend over `window_s` above `max_micros`, or above `max_rate_multiple` times the trailing
    hourly rate (0: that rule is off), emits budget.velocity once per window; `pause` makes the
    ledger refuse the budget (402 budget_paused) until an operator resumes it."""

    window_s: int = 300
    max_micros: int = 0
    max_rate_multiple_milli: int = 0
    pause: bool = False

    def __post_init__(self) -> None:
        if type(self.window_s) is not int or not (
                VELOCITY_WINDOW_S_MIN <= self.window_s <= VELOCITY_WINDOW_S_MAX):
            raise InvalidRequest(
                f"alerts.velocity.window_s must be from {VELOCITY_WINDOW_S_MIN} to "
                f"{VELOCITY_WINDOW_S_MAX}", field="alerts.velocity.window_s")
        if type(self.max_micros) is not int or not 0 <= self.max_micros < 2**53:
            raise InvalidRequest("alerts.velocity.max_micros must be a non-negative integer",
                                 field="alerts.velocity.max_micros")
        if not 0 <= self.max_rate_multiple_milli <= VELOCITY_MULTIPLE_MILLI_MAX:
            raise InvalidRequest("alerts.velocity.max_rate_multiple is out of range",
                                 field="alerts.velocity.max_rate_multiple")
        if not self.max_micros and not self.max_rate_multiple_milli:
            raise InvalidRequest(
                "alerts.velocity needs max_micros or max_rate_multiple",
                field="alerts.velocity")

    @property
    def ledger_form(self) -> str:
        """As the ledger keeps it (lua/put_budget.lua): integers, ',' between."""
        return (f"{self.window_s},{self.max_micros},{self.max_rate_multiple_milli},"
                f"{int(self.pause)}")

    @classmethod
    def from_ledger(cls, text: str) -> VelocityAlarm | None:
        if not text:
            return None
        window_s, max_micros, milli, pause = text.split(",")
        return cls(int(window_s), int(max_micros), int(milli), pause == "1")

    @property
    def max_rate_multiple(self) -> float | None:
        return self.max_rate_multiple_milli / 1000 if self.max_rate_multiple_milli else None


def multiple_milli(value: object) -> int:
    """A rate multiple (a JSON number above 1) in thousandths, exactly as written."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest("alerts.velocity.max_rate_multiple must be a number",
                             field="alerts.velocity.max_rate_multiple")
    try:
        milli = Decimal(str(value)) * 1000
    except InvalidOperation as exc:
        raise InvalidRequest("alerts.velocity.max_rate_multiple must be a number",
                             field="alerts.velocity.max_rate_multiple") from exc
    if milli != milli.to_integral_value() or not 1000 < milli <= VELOCITY_MULTIPLE_MILLI_MAX:
        raise InvalidRequest(
            "alerts.velocity.max_rate_multiple must be above 1, at most 1000000, in steps of "
            "0.001", field="alerts.velocity.max_rate_multiple")
    return int(milli)


@dataclass(frozen=True)
class AlertConfig:
    """What a budget alerts on: each threshold (percent of a period's ceiling) once per period
    window, the first refusal of a window, and an optional velocity alarm."""

    thresholds_pct: tuple[int, ...] = THRESHOLDS_PCT_DEFAULT
    velocity: VelocityAlarm | None = None

    def __post_init__(self) -> None:
        pcts = self.thresholds_pct
        if len(pcts) > ALERT_THRESHOLDS_MAX or any(
                type(p) is not int or not 1 <= p <= 100 for p in pcts) or len(set(pcts)) != len(
                pcts):
            raise InvalidRequest(
                f"alerts.thresholds_pct must be up to {ALERT_THRESHOLDS_MAX} distinct whole "
                "percents from 1 to 100", field="alerts.thresholds_pct")

    @property
    def thresholds_ledger_form(self) -> str:
        return " ".join(str(p) for p in sorted(self.thresholds_pct))

    def json(self) -> dict[str, Any]:
        v = self.velocity
        return {
            "thresholds_pct": sorted(self.thresholds_pct),
            "velocity": None if v is None else {
                "window_s": v.window_s, "max_micros": v.max_micros or None,
                "max_rate_multiple": v.max_rate_multiple, "pause": v.pause,
            },
        }


def config_from_ledger(thresholds: str, velocity: str) -> AlertConfig:
    """A definition's alert fields as lua/put_budget.lua writes them ('' for none of each)."""
    return AlertConfig(tuple(int(p) for p in thresholds.split()),
                       VelocityAlarm.from_ledger(velocity))


@dataclass(frozen=True)
class AlertEvent:
    """One event as the ledger keeps it, with its delivery state ('pending', 'delivered',
    'failed')."""

    event_id: str
    type: str
    budget_id: str
    period_key: str
    threshold_pct: int | None
    committed_micros: int
    ceiling_micros: int
    at_ms: int
    tag: str
    state: str = "pending"
    attempts: int = 0
    last_error: str = ""
    done_ms: int | None = None
    # A ledger.drift's own fields (the ledger writes them beside the usual ones): the provider,
    # the UTC day (YYYY-MM-DD), and the two sides that disagree.
    provider: str | None = None
    day: str | None = None
    ledger_micros: int | None = None
    provider_micros: int | None = None
    # A ledger.unseen_booked's: what this booking added (provider and day as above).
    booked_micros: int | None = None

    @property
    def period(self) -> str:
        return self.period_key.split(":", 1)[0]

    def body(self) -> dict[str, Any]:
        """The JSON posted to the webhook: a ledger.drift's carries its own fields as well."""
        body: dict[str, Any] = {
            "event_id": self.event_id, "type": self.type, "budget_id": self.budget_id,
            "period": self.period, "period_key": self.period_key,
            "threshold_pct": self.threshold_pct, "committed_micros": self.committed_micros,
            "ceiling_micros": self.ceiling_micros, "at_ms": self.at_ms,
        }
        if self.type == DRIFT:
            body.update(provider=self.provider, day=self.day, ledger_micros=self.ledger_micros,
                        provider_micros=self.provider_micros)
        elif self.type == UNSEEN_BOOKED:
            body.update(provider=self.provider, day=self.day, booked_micros=self.booked_micros)
        return body

    def json(self) -> dict[str, Any]:
        """As GET /v1/admin/alerts shows it: the body and its delivery."""
        return {**self.body(), "delivery": {
            "state": self.state, "attempts": self.attempts,
            "last_error": self.last_error or None, "done_ms": self.done_ms}}

    @classmethod
    def from_fields(cls, tag: str, fields: Mapping[str, str]) -> AlertEvent:
        threshold = fields.get("threshold_pct", "")
        done = fields.get("done_ms", "")
        ledger, provider = fields.get("ledger_micros", ""), fields.get("provider_micros", "")
        booked = fields.get("booked_micros", "")
        return cls(
            event_id=fields["event_id"], type=fields["type"], budget_id=fields["budget_id"],
            period_key=fields["period_key"], threshold_pct=int(threshold) if threshold else None,
            committed_micros=int(fields["committed_micros"]),
            ceiling_micros=int(fields["ceiling_micros"]), at_ms=int(fields["at_ms"]), tag=tag,
            state=fields.get("state", "pending"), attempts=int(fields.get("attempts") or 0),
            last_error=fields.get("last_error", ""), done_ms=int(done) if done else None,
            provider=fields.get("provider") or None, day=fields.get("day") or None,
            ledger_micros=int(ledger) if ledger else None,
            provider_micros=int(provider) if provider else None,
            booked_micros=int(booked) if booked else None,
        )


def event_id_of(kind: str, budget_id: str, period_key: str, threshold: str) -> str:
    """The id the ledger gives an event (lua/lib.lua alert_emit): the same event, the same id."""
    digest = hashlib.sha1(  # noqa: S324 (an id, not a secret; Redis' redis.sha1hex)
        f"{kind}|{budget_id}|{period_key}|{threshold}".encode()).hexdigest()
    return "evt_" + digest[:32]


def signature(secret: str, body: bytes) -> str:
    """x-ceiling-signature: sha256=<hex HMAC-SHA256 of the raw body>."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def usd(micros: int) -> str:
    return f"${Decimal(micros) / 1_000_000:,.2f}"


def slack_text(event: AlertEvent) -> str:
    if event.type == DRIFT:
        return (f":rotating_light: The ledger's {event.provider} spend on {event.day} "
                f"({usd(event.ledger_micros or 0)}) does not match {event.provider}'s cost report "
                f"({usd(event.provider_micros or 0)}) within the tolerance.")
    if event.type == UNSEEN_BOOKED:
        return (f":receipt: {usd(event.booked_micros or 0)} of {event.provider}'s bill for "
                f"{event.day} that no call through the gateway accounts for was booked into "
                f"*{event.budget_id}*.")
    if event.type == THRESHOLD_CROSSED:
        what = (f"reached {event.threshold_pct}% of its {event.period} ceiling: "
                f"{usd(event.committed_micros)} of {usd(event.ceiling_micros)}")
    elif event.type == EXCEEDED:
        what = (f"refused a call: its {event.period} ceiling of {usd(event.ceiling_micros)} "
                f"is spent ({usd(event.committed_micros)})")
    else:
        what = (f"spent {usd(event.committed_micros)} within its velocity window "
                f"(alarm at {usd(event.ceiling_micros)})" if event.ceiling_micros else
                f"spent {usd(event.committed_micros)} within its velocity window, above its "
                "trailing hourly rate")
    return f":rotating_light: Budget `{event.budget_id}` {what} ({event.period_key})."


def is_slack(url: str) -> bool:
    from urllib.parse import urlsplit
    return (urlsplit(url).hostname or "").lower() in SLACK_HOSTS


def payload(url: str, event: AlertEvent) -> bytes:
    """The raw body posted for `event`: Slack's incoming-webhook shape for a Slack URL (with the
    event under "event" for receivers that read it), the event otherwise."""
    if is_slack(url):
        return json.dumps({"text": slack_text(event), "event": event.body()},
                          separators=(",", ":")).encode()
    return json.dumps(event.body(), separators=(",", ":")).encode()


def backoff_ms(attempt: int) -> int:
    """The wait after failed attempt number `attempt` (1 for the first)."""
    return int(min(ALERT_BACKOFF_MS_MAX, ALERT_BACKOFF_MS_FIRST * 2 ** (attempt - 1)))


Post = Callable[[str, bytes, Mapping[str, str]], Awaitable[int]]
"""Posts a body to a URL with headers; returns the HTTP status. Raises OSError (or any
exception) when no answer came: an attempt that failed."""


@dataclass
class DeliveryReport:
    delivered: int = 0
    retried: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def json(self) -> dict[str, int]:
        return {"delivered": self.delivered, "retried": self.retried, "failed": self.failed}


async def deliver_due(store: AlertOutbox, url: str, secret: str, post: Post,
                      tags: Sequence[str] | None = None) -> DeliveryReport:
    """One delivery pass over every tag's outbox: post each due event, record each outcome."""
    report = DeliveryReport()
    for tag in tags if tags is not None else await store.alert_tags():
        for event in await store.claim_alerts(tag, ALERT_BATCH_MAX, ALERT_CLAIM_LEASE_MS):
            body = payload(url, event)
            headers = {"content-type": "application/json",
                       SIGNATURE_HEADER: signature(secret, body),
                       "x-ceiling-event-id": event.event_id}
            attempt = event.attempts + 1
            try:
                status = await post(url, body, headers)
                error = "" if 200 <= status < 300 else f"HTTP {status}"
            except Exception as exc:  # noqa: BLE001 (any failure of the post is one attempt)
                error = f"{type(exc).__name__}: {exc}"[:ALERT_ERROR_CHARS_MAX]
            if not error:
                await store.finish_alert(event, "delivered", attempt, 0, "")
                report.delivered += 1
            elif attempt >= DELIVERY_ATTEMPTS_MAX:
                await store.finish_alert(event, "failed", attempt, 0, error)
                report.failed += 1
            else:
                now_ms = await store.ledger_time_ms()
                await store.finish_alert(event, "retry", attempt, now_ms + backoff_ms(attempt),
                                         error)
                report.retried += 1
            if error:
                report.errors.append(error)
    return report
