"""Delivery (core/alerts.py deliver_due) from every store to a real receiver on loopback, over
the HTTP client the service uses: signed, deduplicable, retried with backoff, given up on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from api.alerts import http_post
from core.alerts import (
    ALERT_CLAIM_LEASE_MS,
    DELIVERY_ATTEMPTS_MAX,
    SIGNATURE_HEADER,
    THRESHOLD_CROSSED,
    AlertConfig,
    AlertEvent,
    backoff_ms,
    deliver_due,
    payload,
    signature,
)
from core.budgets import Period
from core.ledger import LedgerStore
from infra.alert_receiver import AlertReceiver
from infra.processes import tls_context
from tests.core.stores.test_alerts import put, spend
from tests.support import ManualClock

SECRET = "whsec-test"


@pytest.fixture
def receiver() -> Iterator[AlertReceiver]:
    with AlertReceiver() as r:
        yield r


async def deliver(store: LedgerStore, receiver: AlertReceiver, tag: str) -> tuple[int, ...]:
    async with httpx.AsyncClient(timeout=5.0, verify=tls_context()) as client:
        report = await deliver_due(store, receiver.url, SECRET, http_post(client), [tag])
    return report.delivered, report.retried, report.failed


async def test_each_event_is_posted_once_signed(
    store: LedgerStore, tag: str, receiver: AlertReceiver
) -> None:
    await put(store, tag, (Period.DAY, 1_000))
    for _ in range(10):
        await spend(store, tag, tag, 100)
    assert await deliver(store, receiver, tag) == (3, 0, 0)
    assert await deliver(store, receiver, tag) == (0, 0, 0)
    assert len(receiver.posts) == 3
    for post in receiver.posts:
        assert post.signed_by(SECRET)
        assert not post.signed_by("another secret")
        body = post.json()
        assert set(body) == {"event_id", "type", "budget_id", "period", "period_key",
                             "threshold_pct", "committed_micros", "ceiling_micros", "at_ms"}
        assert (body["type"], body["period"], body["budget_id"]) == (THRESHOLD_CROSSED, "day", tag)
        assert post.headers["x-ceiling-event-id"] == body["event_id"]
    assert sorted(p.json()["threshold_pct"] for p in receiver.posts) == [50, 80, 100]
    assert all(e.state == "delivered" for e in await store.alert_log(tag, 10))


async def test_a_failing_receiver_gets_retries_with_backoff_then_the_event_fails(
    store: LedgerStore, tag: str, receiver: AlertReceiver, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=(50,)))
    await spend(store, tag, tag, 50)
    receiver.fail_next(2)
    assert await deliver(store, receiver, tag) == (0, 1, 0)
    assert await deliver(store, receiver, tag) == (0, 0, 0)  # waits out its backoff
    clock.advance(backoff_ms(1))
    assert await deliver(store, receiver, tag) == (0, 1, 0)
    clock.advance(backoff_ms(2))
    assert await deliver(store, receiver, tag) == (1, 0, 0)
    assert [p.status for p in receiver.posts] == [500, 500, 200]
    assert receiver.event_ids() == [receiver.posts[0].json()["event_id"]]
    [event] = await store.alert_log(tag, 10)
    assert (event.state, event.attempts) == ("delivered", 3)
    # A receiver that never recovers: the event is given up on after the last attempt, and
    # shows as failed with the last error.
    await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=(50, 90)))
    await spend(store, tag, tag, 40)
    receiver.fail_next(DELIVERY_ATTEMPTS_MAX)
    for attempt in range(1, DELIVERY_ATTEMPTS_MAX + 1):
        expected = (0, 0, 1) if attempt == DELIVERY_ATTEMPTS_MAX else (0, 1, 0)
        assert await deliver(store, receiver, tag) == expected
        clock.advance(backoff_ms(attempt))
    assert await deliver(store, receiver, tag) == (0, 0, 0)
    failed = next(e for e in await store.alert_log(tag, 10) if e.threshold_pct == 90)
    assert (failed.state, failed.attempts, failed.last_error) == (
        "failed", DELIVERY_ATTEMPTS_MAX, "HTTP 500")


async def test_an_unreachable_receiver_is_a_failed_attempt(
    store: LedgerStore, tag: str, receiver: AlertReceiver
) -> None:
    await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=(50,)))
    await spend(store, tag, tag, 50)
    receiver.stop()
    assert await deliver(store, receiver, tag) == (0, 1, 0)
    [event] = await store.alert_log(tag, 10)
    assert event.state == "pending"
    assert "Connect" in event.last_error


async def test_a_deliverer_that_dies_leaves_its_events_to_the_next_after_the_lease(
    store: LedgerStore, tag: str, receiver: AlertReceiver, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=(50,)))
    await spend(store, tag, tag, 50)
    taken = await store.claim_alerts(tag, 10, ALERT_CLAIM_LEASE_MS)  # and then it died
    assert len(taken) == 1
    assert await deliver(store, receiver, tag) == (0, 0, 0)
    clock.advance(ALERT_CLAIM_LEASE_MS)
    assert await deliver(store, receiver, tag) == (1, 0, 0)


def test_a_slack_url_gets_slacks_message_format() -> None:
    event = AlertEvent("evt_1", THRESHOLD_CROSSED, "org:acme/team:search", "day:2026-12-01", 80,
                       8_000_000, 10_000_000, 1, "org:acme")
    slack = json.loads(payload("https://hooks.slack.com/services/T0/B0/x", event))
    assert slack["text"] == (":rotating_light: Budget `org:acme/team:search` reached 80% of its "
                             "day ceiling: $8.00 of $10.00 (day:2026-12-01).")
    assert slack["event"]["event_id"] == "evt_1"
    plain = payload("https://example.test/hook", event)
    assert json.loads(plain) == event.body()
    assert signature("s", plain) == signature("s", plain) != signature("t", plain)
    assert SIGNATURE_HEADER == "x-ceiling-signature"
