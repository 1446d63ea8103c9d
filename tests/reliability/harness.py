"""Sidecar workers over real HTTP, and the ledger's books read back, for the reliability tests.

A worker is a careful client of the sidecar API: it reserves on one instance, calls the provider
only with a reservation in hand, and settles with the provider's usage. A settle that gets no
answer (its instance died, the ledger is down) is sent again, with the same body, to the next
instance: settle is idempotent by reservation id. A reserve that was sent and got no answer may
or may not have been admitted, and the worker cannot tell: it does not call the provider, and
the lease, if there is one, is left to expire.

The witness of spend is the stub provider's bill. The books are read from Redis itself
(RedisStore, and a SCAN of the tag's reservation records), never from what an instance says.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx
import redis.asyncio as aioredis

from core.budgets import BudgetId
from core.ledger import ReservationRef, ReservationState, ReservationView
from core.limits import SWEEP_BATCH_MAX
from core.stores import keys
from core.stores.redis import RedisStore
from infra.fleet import Fleet
from infra.soak import http_client

# How long a worker keeps sending one settle around the fleet before it calls it lost: longer
# than an instance takes to restart (a few seconds here) and than the outages the tests inject.
SETTLE_RETRY_S = 60.0
SETTLE_RETRY_PAUSE_S = 0.1
# A worker told to come back later (429, 503) waits Retry-After, then longer each time it is
# told again, up to this.
BACKOFF_FACTOR = 1.5
BACKOFF_S_MAX = 4.0
# Pause before a worker whose instance refused the connection tries the next one.
UNREACHABLE_PAUSE_S = 0.05
# How often the sweeper looks again for leases whose time has come.
SWEEP_POLL_S = 0.25


class Outcome(StrEnum):
    """How one call attempt ended, as the worker saw it."""

    SETTLED = "settled"  # reserved, called, settled
    REFUSED = "refused"  # 402 budget_exceeded: the worker stops
    BUSY = "busy"  # 429 budget_busy: nothing held; retry after Retry-After
    CLOSED = "closed"  # 503: the instance failed closed, nothing was forwarded
    UNREACHABLE = "unreachable"  # the instance refused the connection: nothing was sent
    LOST = "lost"  # the reserve was sent and got no answer: maybe held, so never called
    SETTLING = "settling"  # called; its settle is being sent again in the background
    ORPHANED = "orphaned"  # called and billed, but the ledger that held it was wiped
    UNSETTLED = "unsettled"  # called, and no settle was answered within SETTLE_RETRY_S
    UNEXPECTED = "unexpected"  # any other answer


# Outcomes that mean the system (or the test) broke a promise, once the settles are drained.
FAILURES = frozenset({Outcome.UNSETTLED, Outcome.UNEXPECTED, Outcome.SETTLING})


@dataclass
class Call:
    """One call attempt: its reserve, and for an admitted one the provider call and the settle."""

    worker: int
    instance: int
    sent_s: float  # time.monotonic() when the reserve was sent
    answered_s: float = math.nan
    outcome: Outcome = Outcome.UNEXPECTED
    status: int | None = None
    code: str | None = None
    reason: str | None = None
    forwarded: bool | None = None
    retry_after_s: float = 0.0
    reservation_id: str | None = None
    reserved_micros: int = 0
    charged_micros: int | None = None
    settle_attempts: int = 0
    settled_s: float = math.nan  # time.monotonic() when a settle was answered 200
    settle_late: bool = False
    settle_replayed: bool = False
    detail: str = ""


@dataclass(frozen=True)
class Provisioned:
    budget_id: str
    ceiling_micros: int
    api_key: str
    key_id: str

    @property
    def tag(self) -> str:
        return BudgetId.parse(self.budget_id).tag


def provision(fleet: Fleet, budget_id: str, ceiling_micros: int) -> Provisioned:
    """A `total` budget and one key for it, made through the first instance's admin API."""
    auth = {"Authorization": f"Bearer {fleet.admin_token}"}
    url = fleet.urls[0]
    r = fleet.http.put(f"{url}/v1/admin/budgets/{budget_id}", headers=auth, json={
        "limits": [{"period": "total", "ceiling_micros": ceiling_micros}],
        "timezone": "UTC", "outage_allowance_micros": 0})
    assert r.status_code == 200, r.text
    r = fleet.http.post(f"{url}/v1/admin/keys", headers=auth, json={
        "budget_id": budget_id, "run_ceiling_micros": None, "roles": ["sidecar"]})
    assert r.status_code == 201, r.text
    return Provisioned(budget_id, ceiling_micros, r.json()["api_key"], r.json()["key_id"])


def _error(response: httpx.Response) -> dict[str, Any]:
    try:
        doc = response.json()
    except ValueError:
        return {}
    error = doc.get("error") if isinstance(doc, dict) else None
    return error if isinstance(error, dict) else {}


@dataclass
class Sidecar:
    """The sidecar flow against a fleet, with what every attempt did kept in `calls`."""

    urls: list[str]
    provider_url: str
    api_key: str
    model: str
    max_output_tokens: int
    ttl_ms: int
    calls: list[Call] = field(default_factory=list)
    provider_calls: int = 0
    auth: dict[str, str] = field(init=False)
    # Requests each instance holds right now: where a kill hurts most.
    in_flight: list[int] = field(init=False)
    # Calls between their 201 and the end of their settle: ones the provider may still bill.
    admitted_open: int = 0
    pending: set[asyncio.Task[None]] = field(default_factory=set)

    # One client per instance and one for the provider: httpx's pool scans its connections on
    # every request, and one pool of a thousand connections cost ~20 ms of CPU per request.
    clients: list[httpx.AsyncClient] = field(init=False)
    provider: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.in_flight = [0] * len(self.urls)
        self.auth = {"Authorization": f"Bearer {self.api_key}"}
        self.clients = [http_client() for _ in self.urls]
        self.provider = http_client()

    async def __aenter__(self) -> Sidecar:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.drain()
        for client in (*self.clients, self.provider):
            await client.aclose()

    async def _post(self, instance: int, path: str, body: dict[str, Any]) -> httpx.Response:
        self.in_flight[instance] += 1
        try:
            return await self.clients[instance].post(f"{self.urls[instance]}{path}", json=body,
                                                     headers=self.auth)
        finally:
            self.in_flight[instance] -= 1

    async def call(self, worker: int, instance: int) -> Call:
        call = Call(worker, instance, time.monotonic())
        self.calls.append(call)
        messages = [{"role": "user", "content": f"worker {worker}, call {len(self.calls)}: "
                                                "summarise this ticket in two sentences."}]
        body = {"model": self.model, "messages": messages,
                "max_output_tokens": self.max_output_tokens, "ttl_ms": self.ttl_ms}
        try:
            r = await self._post(instance, "/v1/reservations", body)
        except httpx.ConnectError:
            call.outcome = Outcome.UNREACHABLE
            return call
        except httpx.TransportError as exc:
            call.outcome, call.detail = Outcome.LOST, type(exc).__name__
            return call
        finally:
            call.answered_s = time.monotonic()
        call.status = r.status_code
        if r.status_code != 201:
            error = _error(r)
            call.code, call.reason = error.get("code"), error.get("reason")
            call.forwarded = error.get("forwarded")
            call.outcome = {402: Outcome.REFUSED, 429: Outcome.BUSY, 503: Outcome.CLOSED}.get(
                r.status_code, Outcome.UNEXPECTED)
            call.retry_after_s = float(r.headers.get("retry-after", "1"))
            call.detail = r.text[:300]
            return call
        doc = r.json()
        call.reservation_id, call.reserved_micros = doc["reservation_id"], doc["reserved_micros"]
        self.admitted_open += 1
        usage = await self._provider(messages)
        if usage is None:
            self.admitted_open -= 1
            call.outcome, call.detail = Outcome.UNEXPECTED, "the provider failed"
            return call
        body = {"input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "cached_input_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
        if not await self._settle_once(call, body, call.instance):
            # The worker goes on with its next call; the settle is sent again in the
            # background until an instance answers, as a client's retry queue would.
            call.outcome = Outcome.SETTLING
            task = asyncio.create_task(self._settle_again(call, body))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        return call

    async def _provider(self, messages: list[dict[str, str]]) -> dict[str, Any] | None:
        self.provider_calls += 1
        r = await self.provider.post(f"{self.provider_url}/v1/chat/completions", json={
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens})
        return dict(r.json()["usage"]) if r.status_code == 200 else None

    async def _settle_once(self, call: Call, body: dict[str, Any], instance: int) -> bool:
        """One settle on one instance; False when it should be sent again (no answer, or 503
        with the ledger unreachable)."""
        call.settle_attempts += 1
        try:
            r = await self._post(instance, f"/v1/reservations/{call.reservation_id}/settle", body)
        except httpx.TransportError:
            return False  # the instance died or is down: the next one gets the same body
        if r.status_code == 200:
            doc = r.json()
            call.outcome, call.charged_micros = Outcome.SETTLED, int(doc["charged_micros"])
            call.settled_s = time.monotonic()
            call.settle_late, call.settle_replayed = bool(doc["late"]), bool(doc["replayed"])
        elif r.status_code == 503 and _error(r).get("reason") == "ledger_reset":
            # The ledger that held this call is gone; the provider's bill is now the only
            # record of it, and the operator books it from there.
            call.outcome = Outcome.ORPHANED
        elif r.status_code == 503:
            return False
        else:
            call.outcome, call.detail = Outcome.UNEXPECTED, f"settle: {r.text[:300]}"
        self.admitted_open -= 1
        return True

    async def _settle_again(self, call: Call, body: dict[str, Any]) -> None:
        instance = call.instance
        deadline_s = time.monotonic() + SETTLE_RETRY_S
        while time.monotonic() < deadline_s:
            instance = (instance + 1) % len(self.urls)
            await asyncio.sleep(SETTLE_RETRY_PAUSE_S)
            if await self._settle_once(call, body, instance):
                return
        call.outcome = Outcome.UNSETTLED
        self.admitted_open -= 1

    async def drain(self) -> None:
        """Wait for the settles still being sent again (each gives up after SETTLE_RETRY_S)."""
        while self.pending:
            await asyncio.gather(*self.pending)

    def outcomes(self) -> Counter[Outcome]:
        return Counter(c.outcome for c in self.calls)

    def failures(self) -> list[Call]:
        return [c for c in self.calls if c.outcome in FAILURES]


async def call_until_answered(sidecar: Sidecar, worker: int, deadline_s: float) -> Call:
    """One call of one worker, as a client makes it: a busy budget or a ledger that did not
    answer in time (503) is waited out, an instance that refuses connections is passed over;
    anything else is the call's answer."""
    instance = worker % len(sidecar.urls)
    waits = 0
    while True:
        call = await sidecar.call(worker, instance)
        if time.monotonic() > deadline_s:
            return call
        if call.outcome in (Outcome.BUSY, Outcome.CLOSED):
            # Both say when to come back; a client that is told again and again backs off
            # further, with jitter, so the workers one settle frees do not all return at once.
            backoff_s = min(BACKOFF_S_MAX, call.retry_after_s * BACKOFF_FACTOR**waits)
            waits += 1
            await asyncio.sleep(random.uniform(call.retry_after_s, max(call.retry_after_s,
                                                                         backoff_s)))
        elif call.outcome is Outcome.UNREACHABLE:
            instance = (instance + 1) % len(sidecar.urls)
            await asyncio.sleep(UNREACHABLE_PAUSE_S)
        else:
            return call


async def call_steadily(sidecar: Sidecar, worker: int, stop: asyncio.Event,
                        pause_s: float) -> None:
    """Calls on the worker's own instance, one after another, until `stop`; a refusal that can
    pass (the ledger down, the instance restarting, a busy budget) is waited out."""
    instance = worker % len(sidecar.urls)
    while not stop.is_set():
        call = await sidecar.call(worker, instance)
        if call.outcome in (Outcome.UNEXPECTED, Outcome.REFUSED):
            return
        if call.outcome is not Outcome.SETTLED:
            await asyncio.sleep(pause_s)


# -- the books ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Books:
    """One budget's `total` counter and every reservation record of its tag, read from Redis."""

    committed_micros: int
    reserved_micros: int
    overshoot_micros: int
    open_leases: int
    reservations: dict[str, ReservationView]
    # Records of the tag that the key did not make (an operator's booking).
    foreign: tuple[str, ...]


async def read_books(redis_url: str, who: Provisioned) -> Books:
    """Only on a ledger that has its identity: on a wiped one, RedisStore would make a new one."""
    bid = BudgetId.parse(who.budget_id)
    store = RedisStore(redis_url)
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        (leg,) = await store.status((bid,))
        prefix = keys.reservation(bid.tag, "")
        ids = [str(k).removeprefix(prefix)
               async for k in raw.scan_iter(match=f"{prefix}*", count=1_000)]
        views, foreign = {}, []
        for rid in ids:
            view = await store.reservation(ReservationRef(bid.tag, rid, who.key_id))
            if view is None:
                foreign.append(rid)
            else:
                views[rid] = view
        open_leases = int(await raw.zcard(keys.open_leases(bid.tag)))
    finally:
        await raw.aclose()
        await store.close()
    return Books(leg.committed_micros, leg.reserved_micros, leg.overshoot_micros, open_leases,
                 views, tuple(sorted(foreign)))


async def expire_leases(redis_url: str, tag: str, wait_s_max: float) -> int:
    """Resolve the tag's leases as the sweeper does, waiting (at most wait_s_max) for the open
    ones to pass; returns how many were expired. Only in the black-box tests: the lease times
    are the ledger's, so waiting is the only way to get past them."""
    store = RedisStore(redis_url)
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    deadline_s = time.monotonic() + wait_s_max
    expired = 0
    try:
        while True:
            expired += await store.expire(tag, SWEEP_BATCH_MAX)
            if await raw.zcard(keys.open_leases(tag)) == 0 or time.monotonic() > deadline_s:
                return expired
            await asyncio.sleep(SWEEP_POLL_S)
    finally:
        await raw.aclose()
        await store.close()


@dataclass(frozen=True)
class Reconciliation:
    """The workers' record against the ledger's, reservation by reservation.

    `problems` lists every broken promise with the reservation it concerns: an admitted call
    missing from the ledger or not settled at what its worker settled, or a reservation nobody
    saw admitted that is not an expired lease charged as outcome 'unknown'.
    """

    seen: int
    settled_micros: int
    unknown: int
    unknown_micros: int
    late: int
    replayed: int
    problems: tuple[str, ...]


def reconcile(calls: Iterable[Call], books: Books,
              released: Iterable[str] = ()) -> Reconciliation:
    """`released`: reservations the test made and released itself, outside the workers."""
    problems = []
    probes = set(released)
    for rid in probes:
        view = books.reservations.get(rid)
        if view is None or view.state is not ReservationState.RELEASED:
            problems.append(f"{rid}: released by the test, and the ledger says {view}")
    seen = {c.reservation_id: c for c in calls if c.reservation_id is not None}
    settled_micros = late = replayed = 0
    for rid, call in seen.items():
        view = books.reservations.get(rid)
        if view is None:
            problems.append(f"{rid}: admitted, and not in the ledger")
        elif call.outcome is not Outcome.SETTLED or call.charged_micros is None:
            problems.append(f"{rid}: admitted, and its call ended {call.outcome}")
        elif (view.state, view.charged_micros) != (ReservationState.SETTLED, call.charged_micros):
            problems.append(f"{rid}: the worker settled {call.charged_micros}, the ledger says "
                            f"{view.state} {view.charged_micros}")
        else:
            settled_micros += call.charged_micros
            late += call.settle_late
            replayed += call.settle_replayed
    unknown = [v for rid, v in books.reservations.items() if rid not in seen and rid not in probes]
    problems += [f"{v.reservation_id}: nobody saw it admitted, and it is {v.state} "
                 f"(outcome {v.outcome!r}), not an expired lease charged as unknown"
                 for v in unknown
                 if v.state is not ReservationState.EXPIRED or v.outcome != "unknown"]
    return Reconciliation(len(seen), settled_micros, len(unknown),
                          sum(v.reserved_micros for v in unknown), late, replayed,
                          tuple(problems))
