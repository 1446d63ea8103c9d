"""Records a ledger already holds, written as versions before Python names wrote them, read on.

Readers of both, not a migration: a record is read in whichever form it is kept, and the next
step that writes it writes the new form (a record is a string by RECORD_FIELDS' names; a budget
definition has Python field names and the ledger id; a reply and an API key record have Python
field names). Each legacy form below is written the way the earlier scripts and store wrote it,
then driven through the store, on the library's functions and on the scripts alike.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from core.budgets import BudgetId, Period
from core.errors import BudgetNotFound, IdempotencyConflict, ReservationResolved
from core.ledger import (
    ClaimKind,
    Correction,
    ReplyRef,
    ReservationRef,
    ReservationState,
    StoredReply,
)
from core.stores import keys
from core.stores.redis import RedisStore
from infra.redis_server import RedisServer
from tests.core.stores.test_conformance import OWNER, leg, request
from tests.support import ManualClock

HELD = 100
BY = Correction("admin:0123456789abcdef", "invoice 7")


@pytest.fixture(params=[True, False], ids=["functions", "scripts"])
async def store(
    request: pytest.FixtureRequest, redis_server: RedisServer, clock: ManualClock
) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_server.url, clock=clock, functions=request.param)
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def legacy_budget(raw: aioredis.Redis, store: RedisStore, tag: str,
                        ceiling_micros: int = 10_000) -> None:
    """A budget as put_budget wrote it: the ledger id in the tag's meta hash only, short names."""
    await raw.hset(keys.meta(tag), "ledger", await store.open())
    await raw.hset(keys.definition(tag, tag), mapping={
        "tz": "UTC", "allow": "0", "ceil:total": str(ceiling_micros)})


async def legacy_reservation(raw: aioredis.Redis, clock: ManualClock, tag: str, state: str,
                             **resolved: str) -> str:
    """A reservation of HELD in the total leg, as reserve.lua wrote it (then a resolution's
    fields over it); for an open one, its hold in the counter and its lease in the open set."""
    rid = uuid.uuid4().hex
    expires_at_ms = clock.now_ms + 60_000
    await raw.hset(keys.reservation(tag, rid), mapping={
        "st": state, "fp": "fp", "owner": OWNER, "amt": str(HELD), "exp": str(expires_at_ms),
        "ver": "old-prices\twith a tab", "model": "old-model", "pol": "charge",
        "legs": f"{tag}|total|10000|0|0", "created_ms": str(clock.now_ms), **resolved})
    counter = keys.counter(tag, tag, "total")
    if state == "o":
        await raw.hincrby(counter, "reserved", HELD)
        await raw.zadd(keys.open_leases(tag), {rid: expires_at_ms})
    elif state == "x":
        await raw.hincrby(counter, "committed", HELD)  # expiry charged it: outcome unknown
    return rid


async def kept_as_string(raw: aioredis.Redis, tag: str, rid: str) -> bool:
    return str(await raw.type(keys.reservation(tag, rid))) == "string"


async def test_an_open_reservation_kept_as_a_hash_is_settled_and_rewritten(
    store: RedisStore, raw: aioredis.Redis, clock: ManualClock, tag: str
) -> None:
    await legacy_budget(raw, store, tag)
    rid = await legacy_reservation(raw, clock, tag, "o")
    ref = ReservationRef(tag, rid, OWNER)
    view = await store.reservation(ref)
    assert view is not None
    assert (view.state, view.reserved_micros, view.model, view.price_version) == (
        ReservationState.OPEN, HELD, "old-model", "old-prices\twith a tab")
    settled = await store.settle(ref, 70)
    assert (settled.charged_micros, settled.released_micros, settled.replayed) == (70, 30, False)
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros) == (70, 0)
    assert await kept_as_string(raw, tag, rid)
    again = await store.settle(ref, 70)
    assert (again.charged_micros, again.released_micros, again.replayed) == (70, 30, True)
    assert not await raw.zscore(keys.open_leases(tag), rid)
    later = await store.inspect(tag, rid)
    assert later is not None
    assert (later.state, later.outcome, later.charged_micros, later.model) == (
        ReservationState.SETTLED, "settled", 70, "old-model")


async def test_an_open_reservation_kept_as_a_hash_is_released_or_expired(
    store: RedisStore, raw: aioredis.Redis, clock: ManualClock, tag: str
) -> None:
    await legacy_budget(raw, store, tag)
    released = await legacy_reservation(raw, clock, tag, "o")
    expiring = await legacy_reservation(raw, clock, tag, "o")
    assert (await store.release(ReservationRef(tag, released, OWNER))).released_micros == HELD
    clock.advance(60_000)
    assert await store.expire(tag, 100) == 1
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros) == (HELD, 0)
    view = await store.inspect(tag, expiring)
    assert view is not None
    assert (view.state, view.outcome) == (ReservationState.EXPIRED, "unknown")
    # The operator's correction of the unknown outcome, on the record expiry rewrote.
    corrected = await store.correct(tag, expiring, 20, BY)
    assert (corrected.charged_micros, corrected.late) == (20, True)
    assert (await leg(store, tag)).committed_micros == 20


async def test_resolved_reservations_kept_as_hashes_answer_replays(
    store: RedisStore, raw: aioredis.Redis, clock: ManualClock, tag: str
) -> None:
    await legacy_budget(raw, store, tag)
    settled = await legacy_reservation(
        raw, clock, tag, "s", act="40", charged="40", rel="60", over="0", late="0",
        outcome="settled", resolved_ms=str(clock.now_ms))
    released = await legacy_reservation(
        raw, clock, tag, "r", rel=str(HELD), outcome="released", resolved_ms=str(clock.now_ms))
    unknown = await legacy_reservation(
        raw, clock, tag, "x", outcome="unknown", resolved_ms=str(clock.now_ms))
    books = await leg(store, tag)

    again = await store.settle(ReservationRef(tag, settled, OWNER), 40)
    assert (again.charged_micros, again.released_micros, again.replayed) == (40, 60, True)
    with pytest.raises(IdempotencyConflict):
        await store.settle(ReservationRef(tag, settled, OWNER), 41)
    with pytest.raises(ReservationResolved) as replay:
        await store.reserve(request(tag, tag, HELD, rid=settled))
    assert (replay.value.details["state"], replay.value.details["charged_micros"]) == (
        "settled", 40)
    assert (await store.release(ReservationRef(tag, released, OWNER))).replayed
    with pytest.raises(ReservationResolved):
        await store.settle(ReservationRef(tag, released, OWNER), 1)
    with pytest.raises(ReservationResolved) as replay:
        await store.reserve(request(tag, tag, HELD, rid=unknown))
    assert (replay.value.details["outcome"], replay.value.details["charged_micros"]) == (
        "unknown", HELD)
    assert await leg(store, tag) == books  # replays book nothing


async def test_a_budget_put_under_short_names_applies_until_it_is_put_again(
    store: RedisStore, raw: aioredis.Redis, tag: str
) -> None:
    await legacy_budget(raw, store, tag, ceiling_micros=500)
    held = await store.reserve(request(tag, tag, 300))
    assert [(x.window_key, x.ceiling_micros, x.reserved_micros) for x in held.legs] == [
        ("total", 500, 300)]
    budget = await store.get_budget(BudgetId(tag))
    assert budget is not None
    assert [(lim.period, lim.ceiling_micros) for lim in budget.limits] == [(Period.TOTAL, 500)]
    # A budget put under another ledger's id does not apply, in either form.
    await raw.hset(keys.meta(tag), "ledger", "another-ledger")
    with pytest.raises(BudgetNotFound):
        await store.reserve(request(tag, tag, 1))
    await raw.hset(keys.meta(tag), "ledger", await store.open())
    # Put again, it is written under the names of today, with the ledger id.
    await store.put_budget(budget)
    fields = await raw.hgetall(keys.definition(tag, tag))
    assert set(fields) == {"ledger", "timezone", "outage_allowance_micros",
                           "ceiling_micros:total", "alert_thresholds_pct", "alert_velocity"}
    assert (await leg(store, tag)).reserved_micros == 300


async def test_replies_and_keys_kept_under_short_names_are_read(
    store: RedisStore, raw: aioredis.Redis, tag: str
) -> None:
    done, flying = ReplyRef(tag, "d-old", "gw:k"), ReplyRef(tag, "f-old", "gw:k")
    await raw.hset(keys.reply(tag, done.digest), mapping={
        "st": "d", "fp": "fp", "tok": "t0", "status": "200",
        "headers": json.dumps([["content-type", "application/json"]]), "body": "{}"})
    await raw.hset(keys.reply(tag, flying.digest), mapping={"st": "f", "fp": "fp", "tok": "t1"})
    found = await store.replies.claim(done, "fp", "t2", 60_000)
    assert (found.kind, found.reply) == (
        ClaimKind.DONE, StoredReply(200, (("content-type", "application/json"),), "{}"))
    assert (await store.replies.claim(done, "other", "t2", 60_000)).kind is ClaimKind.CONFLICT
    assert (await store.replies.claim(flying, "fp", "t2", 60_000)).kind is ClaimKind.IN_FLIGHT
    assert await store.replies.complete(flying, "t1", StoredReply(201, (), "{}"), 60_000)
    finished = await store.replies.claim(flying, "fp", "t3", 60_000)
    assert (finished.kind, finished.reply) == (ClaimKind.DONE, StoredReply(201, (), "{}"))

    await raw.hset(keys.api_key("hash_old" + tag), mapping={
        "key_id": "key_old", "budget_id": tag, "run": "250", "roles": "gateway"})
    record = await store.get_key("hash_old" + tag)
    assert record is not None
    assert record.run_ceiling_micros == 250
