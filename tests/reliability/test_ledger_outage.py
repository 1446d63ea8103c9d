"""The ledger goes away while a fleet serves calls: it fails closed, and comes back with every
micro-dollar it held, or is refused until an operator re-creates it.

1. Redis stopped and restarted with the configuration infra/ ships (AOF everysec, noeviction):
   while it is down every reserve is 503 and no call reaches the provider; when it returns the
   same instance processes admit again, and nothing was refilled (the ledger's committed equals
   the provider's bill).
2. Redis restarted without its data (a wipe): every instance and every reserve says
   `ledger_reset`, nothing is written to the empty Redis, and enforcement stays refused until an
   operator re-creates budgets, keys and the spend already billed; the instances that saw the
   wipe serve again only after a restart. A new instance on the wiped Redis cannot tell (it
   reports `ok`) but refuses every call: no key, no budget.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.ledger import KeyRecord, ReservationRef, ReserveRequest, Role
from core.limits import RESERVATION_TTL_MS_MIN
from core.money import micros_to_usd
from core.service import hash_api_key
from core.stores.redis import RedisStore
from infra.fleet import Fleet
from infra.service import ServiceProcess
from infra.stub_provider import StubProviderProcess, fetch_bill, reset_bill
from tests.reliability.harness import (
    Books,
    Call,
    Outcome,
    Provisioned,
    Reconciliation,
    Sidecar,
    call_steadily,
    expire_leases,
    provision,
    read_books,
    reconcile,
)

pytestmark = pytest.mark.slow

INSTANCES = 3
WORKERS = 6
CEILING_MICROS = 1_000_000
# A cheap model: the ceiling is not what these tests push against.
MODEL = "gpt-4o-mini"
OUTPUT_TOKENS_MAX = 500
PROVIDER_LATENCY_MS = (20, 100)
# Longer than the outage plus a call, so a call in flight across the outage settles inside its
# lease; short enough that a lease nobody settles is swept within the test.
LEASE_TTL_MS = 5_000
# A worker pauses this long after a refusal before its next call.
PAUSE_S = 0.1
UP_BEFORE_S = 2.0
DOWN_S = 3.0
UP_AFTER_S = 2.0
# Calls admitted just before the ledger stopped may still reach the provider this long after.
IN_FLIGHT_GRACE_S = 1.0
# An instance sees the ledger again, or a restarted instance answers, within this.
RECOVERY_S_MAX = 20.0
LEASE_WAIT_S_MAX = LEASE_TTL_MS / 1000 + 10
# The operator's booking of the spend a wiped ledger lost: one record, made once.
ADJUSTMENT_ID = "ledger-reset-adjustment"
OPERATOR = "operator"


def new_fleet() -> Fleet:
    return Fleet(instances=INSTANCES, provider=StubProviderProcess(
        seed=11, latency_ms_min=PROVIDER_LATENCY_MS[0], latency_ms_max=PROVIDER_LATENCY_MS[1]))


def sidecar_for(fleet: Fleet, who: Provisioned) -> Sidecar:
    return Sidecar(fleet.urls, fleet.provider.url, who.api_key, MODEL, OUTPUT_TOKENS_MAX,
                   LEASE_TTL_MS)


async def until(condition: Callable[[], Awaitable[bool]], why: str,
                within_s: float = RECOVERY_S_MAX) -> None:
    deadline_s = time.monotonic() + within_s
    while not await condition():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"not within {within_s} s: {why}")
        await asyncio.sleep(0.1)


async def health(fleet: Fleet) -> list[dict[str, Any]]:
    return await asyncio.to_thread(fleet.health)


async def billed_requests(fleet: Fleet) -> int:
    return (await asyncio.to_thread(fetch_bill, fleet.provider.url)).requests


def pids(fleet: Fleet) -> list[int]:
    return [s.process.pid for s in fleet.services if s.process is not None]


def served_since(sidecar: Sidecar, since_s: float) -> set[int]:
    """Instances that admitted and settled a call sent after `since_s`."""
    return {c.instance for c in sidecar.calls
            if c.sent_s > since_s and c.outcome is Outcome.SETTLED}


def during(calls: list[Call], after_s: float, before_s: float) -> list[Call]:
    """Calls sent after `after_s` and answered before `before_s`."""
    return [c for c in calls if c.sent_s > after_s and c.answered_s < before_s]


async def run_workers(sidecar: Sidecar, scenario: Awaitable[None]) -> None:
    stop = asyncio.Event()
    workers = [asyncio.create_task(call_steadily(sidecar, w, stop, PAUSE_S))
               for w in range(WORKERS)]
    try:
        await scenario
    finally:
        stop.set()
        await asyncio.gather(*workers)


@dataclass(frozen=True)
class Answer:
    status: int
    code: str | None = None
    reason: str | None = None
    forwarded: bool | None = None


async def probe(url: str, who: Provisioned, released: list[str]) -> Answer:
    """Whether one instance enforces: a reserve of one micro-dollar, released at once if it is
    admitted (its id goes in `released`), so a probe spends nothing."""
    auth = {"Authorization": f"Bearer {who.api_key}"}
    async with httpx.AsyncClient(timeout=10.0) as http:
        r = await http.post(f"{url}/v1/reservations", headers=auth, json={"amount_micros": 1})
        if r.status_code == 201:
            rid = r.json()["reservation_id"]
            released.append(rid)
            gone = await http.post(f"{url}/v1/reservations/{rid}/release", headers=auth)
            assert gone.status_code == 200, gone.text
            return Answer(201)
    error = r.json()["error"]
    return Answer(r.status_code, error["code"], error.get("reason"), error.get("forwarded"))


# -- 1. stopped and restarted with AOF ----------------------------------------------------------


@dataclass
class Restarted:
    sidecar: Sidecar
    committed_before_micros: int
    committed_on_return_micros: int
    stopped_s: float
    started_s: float
    health_down: list[dict[str, Any]]
    probes_down: list[Answer]
    health_up: list[dict[str, Any]]
    pids_before: list[int]
    pids_after: list[int]
    requests_down: tuple[int, int]
    billed_micros: int = 0
    billed_calls: int = 0
    provider_requests: int = 0
    books: Books | None = None
    rec: Reconciliation | None = None


async def committed_micros(redis_url: str, who: Provisioned) -> int:
    store = RedisStore(redis_url)
    try:
        (leg,) = await store.status((BudgetId.parse(who.budget_id),))
    finally:
        await store.close()
    return leg.committed_micros


async def restart_durable(fleet: Fleet, who: Provisioned) -> Restarted:
    async with sidecar_for(fleet, who) as sidecar:
        seen: dict[str, Any] = {}

        async def scenario() -> None:
            await asyncio.sleep(UP_BEFORE_S)
            seen["pids_before"] = pids(fleet)
            seen["before"] = await committed_micros(fleet.redis.url, who)
            await asyncio.to_thread(fleet.redis.stop)  # SIGTERM: Redis writes its AOF and exits
            seen["stopped_s"] = time.monotonic()
            seen["health_down"] = await health(fleet)
            # Workers mid-call when it stopped spend the outage retrying their settles; a probe
            # asks every instance for a new reservation as well.
            seen["probes_down"] = [await probe(url, who, []) for url in fleet.urls]
            await asyncio.sleep(IN_FLIGHT_GRACE_S)
            first = await billed_requests(fleet)
            await asyncio.sleep(DOWN_S)
            seen["requests_down"] = (first, await billed_requests(fleet))
            seen["started_s"] = time.monotonic()
            await asyncio.to_thread(fleet.redis.start)  # same port, same AOF
            seen["on_return"] = await committed_micros(fleet.redis.url, who)

            async def all_ok() -> bool:
                return all(h["status"] == "ok" for h in await health(fleet))

            async def all_serving() -> bool:
                return len(served_since(sidecar, seen["started_s"])) == INSTANCES

            await until(all_ok, "every instance healthy again")
            await until(all_serving, "every instance admitting again")
            seen["health_up"] = await health(fleet)
            seen["pids_after"] = pids(fleet)
            await asyncio.sleep(UP_AFTER_S)

        await run_workers(sidecar, scenario())
    return Restarted(sidecar, seen["before"], seen["on_return"], seen["stopped_s"],
                     seen["started_s"], seen["health_down"], seen["probes_down"],
                     seen["health_up"], seen["pids_before"], seen["pids_after"],
                     seen["requests_down"])


@pytest.fixture(scope="module")
def restarted() -> Restarted:
    with new_fleet() as fleet:
        who = provision(fleet, "org:outage", CEILING_MICROS)
        reset_bill(fleet.provider.url)
        obs = asyncio.run(restart_durable(fleet, who))
        bill = fetch_bill(fleet.provider.url)
        asyncio.run(expire_leases(fleet.redis.url, who.tag, LEASE_WAIT_S_MAX))
        obs.books = asyncio.run(read_books(fleet.redis.url, who))
    obs.billed_micros, obs.billed_calls = bill.total.cost_micros, bill.total.calls
    obs.provider_requests = bill.requests
    obs.rec = reconcile(obs.sidecar.calls, obs.books)
    print(restart_summary(obs))
    return obs


def restart_summary(obs: Restarted) -> str:
    down = during(obs.sidecar.calls, obs.stopped_s, obs.started_s)
    outcomes = obs.sidecar.outcomes()
    crossed = sum(c.outcome is Outcome.SETTLED and c.settle_attempts > 1
                  for c in obs.sidecar.calls)
    return (
        f"\nledger outage (AOF): {INSTANCES} instances, {WORKERS} workers, Redis down "
        f"{obs.started_s - obs.stopped_s:.1f} s; {len(down)} reserves while down, answered "
        f"{dict(Counter(f'{c.status} {c.code}' for c in down))}; {crossed} settles retried "
        f"across the outage\n"
        f"  attempts by outcome: {dict(sorted(outcomes.items()))}\n"
        f"  committed before the stop ${micros_to_usd(obs.committed_before_micros)}, on return "
        f"${micros_to_usd(obs.committed_on_return_micros)}; at the end the ledger committed "
        f"${micros_to_usd(obs.books.committed_micros if obs.books else 0)} and the provider "
        f"billed ${micros_to_usd(obs.billed_micros)} for {obs.billed_calls} calls"
    )


def test_while_the_ledger_is_down_every_call_fails_closed(restarted: Restarted) -> None:
    assert [(h["status"], h["reasons"]) for h in restarted.health_down] == [
        ("down", ["ledger_unreachable"])] * INSTANCES
    assert restarted.probes_down == [
        Answer(503, "ledger_unavailable", "ledger_unreachable", False)] * INSTANCES
    down = during(restarted.sidecar.calls, restarted.stopped_s, restarted.started_s)
    assert {(c.status, c.code, c.forwarded) for c in down} == {
        (503, "ledger_unavailable", False)}, restart_summary(restarted)


def test_while_the_ledger_is_down_nothing_reaches_the_provider(restarted: Restarted) -> None:
    first, last = restarted.requests_down
    assert first == last
    # Every request the provider saw came from a call holding a reservation.
    settled = restarted.sidecar.outcomes()[Outcome.SETTLED]
    assert restarted.provider_requests == restarted.sidecar.provider_calls == settled


def test_service_resumes_without_restarting_the_instances(restarted: Restarted) -> None:
    assert restarted.pids_after == restarted.pids_before
    assert [h["status"] for h in restarted.health_up] == ["ok"] * INSTANCES
    assert restarted.sidecar.failures() == []


def test_no_budget_was_refilled(restarted: Restarted) -> None:
    assert restarted.books is not None
    assert restarted.rec is not None
    assert restarted.committed_on_return_micros >= restarted.committed_before_micros > 0
    assert restarted.rec.problems == (), "\n".join(restarted.rec.problems[:20])
    assert restarted.rec.settled_micros == restarted.billed_micros
    assert restarted.books.committed_micros == (
        restarted.billed_micros + restarted.rec.unknown_micros)
    assert (restarted.books.reserved_micros, restarted.books.open_leases) == (0, 0)
    # An unseen lease can only be a reserve whose 503 came after its script had run.
    assert restarted.rec.unknown <= restarted.sidecar.outcomes()[Outcome.CLOSED]


# -- 2. restarted without its data ---------------------------------------------------------------


@dataclass
class Wiped:
    sidecar: Sidecar
    wiped_s: float
    reinitialised_s: float
    restarting_s: float
    restarted_s: float
    health_wiped: list[dict[str, Any]]
    keys_after_refusals: int
    requests_refused: tuple[int, int]
    billed_at_reset_micros: int
    newcomer_health: dict[str, Any]
    newcomer_reserve: Answer
    after_operator: list[Answer]
    health_after_operator: list[dict[str, Any]]
    newcomer_after_operator: Answer
    health_restarted: list[dict[str, Any]]
    probes: tuple[str, ...]
    billed_micros: int = 0
    provider_requests: int = 0
    books: Books | None = None
    rec: Reconciliation | None = None


async def reinitialise(redis_url: str, who: Provisioned, billed_micros: int) -> None:
    """The operator's re-initialisation of a wiped ledger, with the core's own operations: the
    steps the proposed `ceiling ledger reset` runs. The budget first, then the spend the provider
    has billed against it, and only then the key, so no call sees the budget refilled."""
    store = RedisStore(redis_url)
    bid = BudgetId.parse(who.budget_id)
    try:
        await store.open()
        await store.put_budget(BudgetDef(bid, (Limit(Period.TOTAL, who.ceiling_micros),)))
        booking = ReserveRequest(
            ref=ReservationRef(bid.tag, ADJUSTMENT_ID, OPERATOR), budget_ids=bid.lineage,
            amount_micros=billed_micros, ttl_ms=RESERVATION_TTL_MS_MIN,
            fingerprint=ADJUSTMENT_ID, price_version="provider-bill",
        )
        await store.book(booking, billed_micros, int(time.time() * 1000))
        # From the operator's export of key records: only the hash was ever stored.
        await store.put_key(KeyRecord(who.key_id, hash_api_key(who.api_key), bid, None,
                                      frozenset({Role.SIDECAR})))
    finally:
        await store.close()


async def wipe_and_recover(fleet: Fleet, who: Provisioned, newcomer: ServiceProcess) -> Wiped:
    raw = aioredis.Redis.from_url(fleet.redis.url, decode_responses=True)
    probes: list[str] = []
    async with sidecar_for(fleet, who) as sidecar:
        seen: dict[str, Any] = {}

        async def scenario() -> None:
            await asyncio.sleep(UP_BEFORE_S)
            await asyncio.to_thread(fleet.redis.restart, wipe=True)
            seen["wiped_s"] = time.monotonic()

            async def all_reset() -> bool:
                return all(h["reasons"] == ["ledger_reset"] for h in await health(fleet))

            async def none_in_flight() -> bool:
                return sidecar.admitted_open == 0

            await until(all_reset, "every instance reports ledger_reset")
            seen["health_wiped"] = await health(fleet)
            # Calls admitted before the wipe finish; their provider calls are on the bill.
            await until(none_in_flight, "calls admitted before the wipe finish")
            first = await billed_requests(fleet)
            await asyncio.sleep(DOWN_S)  # refused for as long as nobody acts
            seen["requests_refused"] = (first, await billed_requests(fleet))
            seen["keys_after_refusals"] = int(await raw.dbsize())
            seen["billed_at_reset"] = (
                await asyncio.to_thread(fetch_bill, fleet.provider.url)).total.cost_micros
            # A new instance on the wiped Redis makes a new ledger there and cannot tell.
            await asyncio.to_thread(newcomer.start)
            async with httpx.AsyncClient(timeout=10.0) as http:
                seen["newcomer_health"] = (await http.get(f"{newcomer.url}/health")).json()
            seen["newcomer_reserve"] = await probe(newcomer.url, who, probes)

            await reinitialise(fleet.redis.url, who, seen["billed_at_reset"])
            seen["reinitialised_s"] = time.monotonic()
            seen["after_operator"] = [await probe(url, who, probes) for url in fleet.urls]
            seen["health_after_operator"] = await health(fleet)
            seen["newcomer_after_operator"] = await probe(newcomer.url, who, probes)

            seen["restarting_s"] = time.monotonic()
            await asyncio.gather(*(asyncio.to_thread(restart_service, s)
                                   for s in fleet.services))
            seen["restarted_s"] = time.monotonic()

            async def all_serving() -> bool:
                return len(served_since(sidecar, seen["restarted_s"])) == INSTANCES

            await until(all_serving, "every restarted instance admitting again")
            seen["health_restarted"] = await health(fleet)
            await asyncio.sleep(UP_AFTER_S)

        try:
            await run_workers(sidecar, scenario())
        finally:
            await raw.aclose()
    return Wiped(sidecar, seen["wiped_s"], seen["reinitialised_s"], seen["restarting_s"],
                 seen["restarted_s"],
                 seen["health_wiped"], seen["keys_after_refusals"], seen["requests_refused"],
                 seen["billed_at_reset"], seen["newcomer_health"], seen["newcomer_reserve"],
                 seen["after_operator"], seen["health_after_operator"],
                 seen["newcomer_after_operator"], seen["health_restarted"], tuple(probes))


def restart_service(service: ServiceProcess) -> None:
    service.stop()
    service.start()


@pytest.fixture(scope="module")
def wiped() -> Wiped:
    with new_fleet() as fleet:
        newcomer = ServiceProcess(env=fleet.service_env(),
                                  log_path=str(fleet.workdir / "newcomer.log"))
        try:
            who = provision(fleet, "org:wiped", CEILING_MICROS)
            reset_bill(fleet.provider.url)
            obs = asyncio.run(wipe_and_recover(fleet, who, newcomer))
        finally:
            newcomer.stop()
        bill = fetch_bill(fleet.provider.url)
        asyncio.run(expire_leases(fleet.redis.url, who.tag, LEASE_WAIT_S_MAX))
        obs.books = asyncio.run(read_books(fleet.redis.url, who))
    obs.billed_micros, obs.provider_requests = bill.total.cost_micros, bill.requests
    after = [c for c in obs.sidecar.calls if c.sent_s > obs.reinitialised_s]
    obs.rec = reconcile(after, obs.books, released=obs.probes)
    print(wipe_summary(obs))
    return obs


def wipe_summary(obs: Wiped) -> str:
    refused = during(obs.sidecar.calls, obs.wiped_s, obs.restarting_s)
    outcomes = obs.sidecar.outcomes()
    return (
        f"\nledger wiped: {INSTANCES} instances, {WORKERS} workers; refused for "
        f"{obs.reinitialised_s - obs.wiped_s:.1f} s until the operator acted, "
        f"{obs.restarting_s - obs.wiped_s:.1f} s until the instances were restarted; "
        f"{len(refused)} reserves in between answered "
        f"{dict(Counter(f'{c.status} {c.reason or c.code}' for c in refused))}\n"
        f"  attempts by outcome: {dict(sorted(outcomes.items()))}\n"
        f"  billed before the operator acted ${micros_to_usd(obs.billed_at_reset_micros)} "
        f"(booked as a 'total' adjustment); billed in all ${micros_to_usd(obs.billed_micros)}; "
        f"the new ledger committed "
        f"${micros_to_usd(obs.books.committed_micros if obs.books else 0)}"
    )


def test_a_wipe_is_detected_on_every_instance_and_every_reserve(wiped: Wiped) -> None:
    assert [(h["status"], h["reasons"]) for h in wiped.health_wiped] == [
        ("down", ["ledger_reset"])] * INSTANCES
    refused = during(wiped.sidecar.calls, wiped.wiped_s, wiped.reinitialised_s)
    assert {c.instance for c in refused} == set(range(INSTANCES))
    assert {(c.status, c.reason, c.forwarded) for c in refused} == {
        (503, "ledger_reset", False)}, wipe_summary(wiped)


def test_a_wiped_ledger_is_not_written_to_or_served(wiped: Wiped) -> None:
    # Nothing re-created the ledger on its own: no new identity, no budget, no counter.
    assert wiped.keys_after_refusals == 0
    first, last = wiped.requests_refused
    assert first == last
    before_restart = [c for c in wiped.sidecar.calls
                      if wiped.wiped_s < c.sent_s and c.answered_s < wiped.restarting_s]
    assert not any(c.status == 201 for c in before_restart)
    # Calls admitted before the wipe and settled after it: only the bill remembers them.
    assert wiped.sidecar.failures() == []


def test_a_new_instance_on_a_wiped_ledger_cannot_tell_but_refuses(wiped: Wiped) -> None:
    assert wiped.newcomer_health["status"] == "ok"  # a fresh ledger looks like any other
    assert wiped.newcomer_reserve == Answer(401, "unauthorized")  # gone with the data: the key


def test_an_instance_that_saw_the_wipe_refuses_until_restarted(wiped: Wiped) -> None:
    assert wiped.after_operator == [
        Answer(503, "ledger_unavailable", "ledger_reset", False)] * INSTANCES
    assert [h["reasons"] for h in wiped.health_after_operator] == [["ledger_reset"]] * INSTANCES
    assert wiped.newcomer_after_operator == Answer(201)
    assert [h["status"] for h in wiped.health_restarted] == ["ok"] * INSTANCES


def test_after_the_operator_the_budget_holds_what_was_billed(wiped: Wiped) -> None:
    assert wiped.books is not None
    assert wiped.rec is not None
    assert wiped.books.foreign == (ADJUSTMENT_ID,)
    assert wiped.rec.problems == (), "\n".join(wiped.rec.problems[:20])
    # The new ledger's committed is the whole bill: what the operator booked from it, and
    # every call settled since; nothing was refilled.
    assert wiped.books.committed_micros == wiped.billed_micros + wiped.rec.unknown_micros
    assert wiped.rec.settled_micros == wiped.billed_micros - wiped.billed_at_reset_micros
    assert (wiped.books.reserved_micros, wiped.books.open_leases) == (0, 0)
