"""The ledger goes away while a fleet serves calls: it fails closed, and comes back with every
micro-dollar it held, or is refused until an operator re-creates it.

1. Redis stopped and restarted with the configuration infra/ ships (AOF everysec, noeviction):
   while it is down every reserve is 503 and no call reaches the provider; when it returns the
   same instance processes admit again, and nothing was refilled (the ledger's committed equals
   the provider's bill).
2. Redis restarted without its data (a wipe): every instance and every reserve says
   `ledger_reset`, nothing is written to the empty Redis, and enforcement stays refused until an
   operator restores the last export (`ceiling ledger restore`, with the provider's bill for
   the spend since) and confirms it (`ceiling ledger adopt`); then the same instances serve
   again, without a restart, with the keys they had, and the ledger's committed is the whole
   bill. A new instance on the wiped Redis cannot tell (it reports `ok`) but refuses every
   call: no key, no budget.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from core.budgets import BudgetId
from core.money import micros_to_usd
from core.operations import BILL_FORMAT
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
    exported_s: float
    wiped_s: float
    restored_s: float
    adopting_s: float  # the operator ran `ceiling ledger adopt`
    adopted_s: float  # ... and it answered
    health_wiped: list[dict[str, Any]]
    keys_after_refusals: int
    requests_refused: tuple[int, int]
    billed_at_reset_micros: int
    newcomer_health: dict[str, Any]
    newcomer_reserve: Answer
    export: dict[str, Any]
    restore: dict[str, Any]
    after_restore: list[Answer]
    health_after_restore: list[dict[str, Any]]
    newcomer_after_restore: Answer
    after_adopt: list[Answer]
    newcomer_after_adopt: Answer
    health_adopted: list[dict[str, Any]]
    pids_before: list[int]
    pids_after: list[int]
    probes: tuple[str, ...]
    billed_micros: int = 0
    provider_requests: int = 0
    books: Books | None = None
    rec: Reconciliation | None = None

    @property
    def exported_open_ids(self) -> set[str]:
        return {r["reservation_id"] for org in self.export["body"]["organisations"]
                for r in org["reservations"] if r["state"] == "open"}

    @property
    def exported_open_micros(self) -> int:
        return sum(r["reserved_micros"] for org in self.export["body"]["organisations"]
                   for r in org["reservations"] if r["state"] == "open")

    @property
    def committed_on_restore_micros(self) -> int:
        (booked,) = self.restore["booked_from_bill"]
        return int(booked["restored_committed_micros"]) + int(booked["booked_micros"])


def ceiling(fleet: Fleet, *args: str) -> dict[str, Any]:
    """The operator's command, as a process of its own with the fleet's ledger and token."""
    env = {**os.environ, "REDIS_URL": fleet.redis.url, "CEILING_ADMIN_TOKEN": fleet.admin_token}
    done = subprocess.run([sys.executable, "-m", "api.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert isinstance(answer, dict)
    return answer


async def wipe_and_recover(fleet: Fleet, who: Provisioned, newcomer: ServiceProcess,
                           workdir: Path) -> Wiped:
    raw = aioredis.Redis.from_url(fleet.redis.url, decode_responses=True)
    probes: list[str] = []
    export_file, bill_file = workdir / "ledger-export.json", workdir / "bill.json"
    async with sidecar_for(fleet, who) as sidecar:
        seen: dict[str, Any] = {}

        async def scenario() -> None:
            await asyncio.sleep(UP_BEFORE_S / 2)
            # The last scheduled export before the wipe, taken under load.
            await asyncio.to_thread(ceiling, fleet, "ledger", "export", str(export_file))
            seen["exported_s"] = time.monotonic()
            await asyncio.sleep(UP_BEFORE_S / 2)
            seen["pids_before"] = pids(fleet)
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

            # The provider's bill for the budget, from its GET /billing (this stub bills only
            # this org's key): what it shows beyond the export is booked by the restore.
            bill_file.write_text(json.dumps({"format": BILL_FORMAT, "entries": [
                {"budget_id": who.budget_id, "billed_micros": seen["billed_at_reset"],
                 "period": "total"}]}))
            seen["restore"] = await asyncio.to_thread(
                ceiling, fleet, "ledger", "restore", str(export_file), "--book-from-bill",
                str(bill_file))
            seen["restored_s"] = time.monotonic()
            seen["after_restore"] = [await probe(url, who, probes) for url in fleet.urls]
            seen["health_after_restore"] = await health(fleet)
            seen["newcomer_after_restore"] = await probe(newcomer.url, who, probes)

            seen["adopting_s"] = time.monotonic()
            await asyncio.to_thread(ceiling, fleet, "ledger", "adopt")
            seen["adopted_s"] = time.monotonic()

            async def all_serving() -> bool:
                return len(served_since(sidecar, seen["adopted_s"])) == INSTANCES

            await until(all_serving, "every instance admitting again, without a restart")
            seen["after_adopt"] = [await probe(url, who, probes) for url in fleet.urls]
            seen["newcomer_after_adopt"] = await probe(newcomer.url, who, probes)
            seen["health_adopted"] = await health(fleet)
            seen["pids_after"] = pids(fleet)
            await asyncio.sleep(UP_AFTER_S)

        try:
            await run_workers(sidecar, scenario())
        finally:
            await raw.aclose()
    return Wiped(sidecar, seen["exported_s"], seen["wiped_s"], seen["restored_s"],
                 seen["adopting_s"], seen["adopted_s"], seen["health_wiped"],
                 seen["keys_after_refusals"],
                 seen["requests_refused"], seen["billed_at_reset"], seen["newcomer_health"],
                 seen["newcomer_reserve"], json.loads(export_file.read_text()),
                 seen["restore"], seen["after_restore"], seen["health_after_restore"],
                 seen["newcomer_after_restore"], seen["after_adopt"],
                 seen["newcomer_after_adopt"], seen["health_adopted"], seen["pids_before"],
                 seen["pids_after"], tuple(probes))


@pytest.fixture(scope="module")
def wiped() -> Wiped:
    with new_fleet() as fleet:
        newcomer = ServiceProcess(env=fleet.service_env(),
                                  log_path=str(fleet.workdir / "newcomer.log"))
        try:
            who = provision(fleet, "org:wiped", CEILING_MICROS)
            reset_bill(fleet.provider.url)
            obs = asyncio.run(wipe_and_recover(fleet, who, newcomer, Path(fleet.workdir)))
        finally:
            newcomer.stop()
        bill = fetch_bill(fleet.provider.url)
        asyncio.run(expire_leases(fleet.redis.url, who.tag, LEASE_WAIT_S_MAX))
        obs.books = asyncio.run(read_books(fleet.redis.url, who))
    obs.billed_micros, obs.provider_requests = bill.total.cost_micros, bill.requests
    after = [c for c in obs.sidecar.calls if c.sent_s > obs.restored_s]
    # The export's open reservations, restored as charged: read apart from the workers' calls.
    restored = {rid: v for rid, v in obs.books.reservations.items()
                if rid in obs.exported_open_ids}
    books = replace(obs.books, reservations={
        rid: v for rid, v in obs.books.reservations.items() if rid not in restored})
    obs.rec = reconcile(after, books, released=obs.probes)
    print(wipe_summary(obs))
    return obs


def wipe_summary(obs: Wiped) -> str:
    refused = during(obs.sidecar.calls, obs.wiped_s, obs.adopting_s)
    outcomes = obs.sidecar.outcomes()
    first_s = min((c.answered_s for c in obs.sidecar.calls
                   if c.sent_s > obs.adopting_s and c.status == 201), default=math.nan)
    return (
        f"\nledger wiped: {INSTANCES} instances, {WORKERS} workers; export taken "
        f"{obs.wiped_s - obs.exported_s:.1f} s before the wipe; refused for "
        f"{obs.restored_s - obs.wiped_s:.1f} s until the restore, "
        f"{obs.adopting_s - obs.wiped_s:.1f} s until the operator's adopt, the first call "
        f"admitted {first_s - obs.adopting_s:.1f} s after it; "
        f"{len(refused)} reserves in between answered "
        f"{dict(Counter(f'{c.status} {c.reason or c.code}' for c in refused))}\n"
        f"  attempts by outcome: {dict(sorted(outcomes.items()))}\n"
        f"  billed before the restore ${micros_to_usd(obs.billed_at_reset_micros)}; restored "
        f"${micros_to_usd(obs.committed_on_restore_micros)} (export + bill gap; "
        f"{len(obs.exported_open_ids)} open holds charged as unknown, "
        f"${micros_to_usd(obs.exported_open_micros)}); billed in all "
        f"${micros_to_usd(obs.billed_micros)}; the ledger committed "
        f"${micros_to_usd(obs.books.committed_micros if obs.books else 0)}"
    )


def test_a_wipe_is_detected_on_every_instance_and_every_reserve(wiped: Wiped) -> None:
    assert [(h["status"], h["reasons"]) for h in wiped.health_wiped] == [
        ("down", ["ledger_reset"])] * INSTANCES
    refused = during(wiped.sidecar.calls, wiped.wiped_s, wiped.adopting_s)
    assert {c.instance for c in refused} == set(range(INSTANCES))
    assert {(c.status, c.reason, c.forwarded) for c in refused} == {
        (503, "ledger_reset", False)}, wipe_summary(wiped)


def test_a_wiped_ledger_is_not_written_to_or_served(wiped: Wiped) -> None:
    # Nothing re-created the ledger on its own: no new identity, no budget, no counter.
    assert wiped.keys_after_refusals == 0
    first, last = wiped.requests_refused
    assert first == last
    before_adopt = [c for c in wiped.sidecar.calls
                    if wiped.wiped_s < c.sent_s and c.answered_s < wiped.adopting_s]
    assert not any(c.status == 201 for c in before_adopt)
    # Calls admitted before the wipe and settled after it: only the bill remembers them.
    assert wiped.sidecar.failures() == []


def test_a_new_instance_on_a_wiped_ledger_cannot_tell_but_refuses(wiped: Wiped) -> None:
    assert wiped.newcomer_health["status"] == "ok"  # a fresh ledger looks like any other
    assert wiped.newcomer_reserve == Answer(401, "unauthorized")  # gone with the data: the key


def test_a_restored_ledger_is_served_only_once_the_operator_adopts_it(wiped: Wiped) -> None:
    reset = Answer(503, "ledger_unavailable", "ledger_reset", False)
    assert wiped.after_restore == [reset] * INSTANCES
    assert [h["reasons"] for h in wiped.health_after_restore] == [["ledger_reset"]] * INSTANCES
    assert wiped.newcomer_after_restore == reset  # its fresh ledger id is not the restored one
    # Adopted without a restart: the same processes serve, with the keys they had.
    assert wiped.after_adopt == [Answer(201)] * INSTANCES
    assert wiped.newcomer_after_adopt == Answer(201)
    assert wiped.pids_after == wiped.pids_before
    assert [h["status"] for h in wiped.health_adopted] == ["ok"] * INSTANCES
    assert wiped.restore["keys"] == 1
    assert wiped.restore["ledger_id"] not in (wiped.export["ledger_id"], None)


def test_after_the_restore_the_budget_holds_the_whole_bill(wiped: Wiped) -> None:
    assert wiped.books is not None
    assert wiped.rec is not None
    assert wiped.rec.problems == (), "\n".join(wiped.rec.problems[:20])
    (booking,) = wiped.books.foreign  # the restore's booking of the bill's gap
    assert booking == wiped.restore["booked_from_bill"][0].get("reservation_id", booking)
    # Nothing refilled: the restored ledger holds at least the whole bill up to the wipe, and
    # more only by the export's open holds, charged as unknown (held, never dropped).
    over = wiped.committed_on_restore_micros - wiped.billed_at_reset_micros
    assert 0 <= over <= wiped.exported_open_micros
    restored = [v for rid, v in wiped.books.reservations.items() if rid in wiped.exported_open_ids]
    assert {(v.state.value, v.outcome) for v in restored} <= {("expired", "unknown")}
    assert len(restored) == len(wiped.exported_open_ids)
    # The ledger's committed is the whole bill: what the restore put back, and every call
    # settled since; plus leases nobody settled, charged as unknown, and that same `over`.
    assert wiped.books.committed_micros == (
        wiped.billed_micros + wiped.rec.unknown_micros + over)
    assert wiped.rec.settled_micros == wiped.billed_micros - wiped.billed_at_reset_micros
    assert (wiped.books.reserved_micros, wiped.books.open_leases) == (0, 0)
