"""The ledger's vocabulary and the one protocol every store implements.

A store holds budgets, API-key records and reservations, and runs the four ledger operations
atomically: reserve, settle, release, expire. The conformance suite (tests/core/stores) is the
definition of a store; RedisStore runs the lua/ scripts, MemoryStore the same semantics in Python
for one process.

Invariant, for every counter (one budget in one period window):
    committed + reserved <= ceiling + overshoot
where overshoot is what settles charged beyond what was held for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

from core.budgets import BudgetDef, BudgetId, Period, period_of
from core.errors import BudgetBusy, BudgetExceeded, BudgetRefused
from core.replies import ReplyStore

# A busy budget frees up when an open call settles, which takes seconds, not a lease's length.
BUSY_RETRY_AFTER_S = 1


class ExpirePolicy(StrEnum):
    """What expiry does with a lease nobody settled: see lua/lib.lua expire_one."""

    CHARGE = "charge"
    RELEASE = "release"


@dataclass(frozen=True)
class ReservationRef:
    """Addresses one reservation: its tag (top scope), its id and the owner allowed to touch it."""

    tag: str
    reservation_id: str
    owner: str


@dataclass(frozen=True)
class RunLimit:
    """A run budget: a 'total' ceiling held in the ledger with no stored definition."""

    budget_id: BudgetId
    ceiling_micros: int


@dataclass(frozen=True)
class ReserveRequest:
    ref: ReservationRef
    budget_ids: tuple[BudgetId, ...]
    amount_micros: int
    ttl_ms: int
    fingerprint: str
    price_version: str
    model: str = ""
    expire_policy: ExpirePolicy = ExpirePolicy.CHARGE
    run: RunLimit | None = None


class LegStatus(NamedTuple):
    """One budget in one period window, as the ledger saw it.

    A NamedTuple, not a frozen dataclass: every reserve builds one per leg from the script's
    reply, and a frozen dataclass' __init__ costs four times as much CPU."""

    budget_id: str
    window_key: str
    ceiling_micros: int
    committed_micros: int
    reserved_micros: int
    overshoot_micros: int
    resets_at_ms: int | None
    outage_allowance_micros: int

    @property
    def period(self) -> Period:
        return period_of(self.window_key)

    @property
    def remaining_micros(self) -> int:
        return max(0, self.ceiling_micros - self.committed_micros - self.reserved_micros)


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    reserved_micros: int
    expires_at_ms: int
    now_ms: int
    replayed: bool
    legs: tuple[LegStatus, ...]


@dataclass(frozen=True)
class Settlement:
    charged_micros: int
    released_micros: int
    overshoot_micros: int
    late: bool
    replayed: bool


@dataclass(frozen=True)
class Release:
    released_micros: int
    replayed: bool


class ReservationState(StrEnum):
    OPEN = "open"
    SETTLED = "settled"
    RELEASED = "released"
    EXPIRED = "expired"


STATE_CODES = {"o": ReservationState.OPEN, "s": ReservationState.SETTLED,
               "r": ReservationState.RELEASED, "x": ReservationState.EXPIRED}


@dataclass(frozen=True)
class ReservationView:
    """A reservation as stored. `outcome`: '' while open; 'settled' or 'released'; for a lease
    that expired, 'unknown' (expiry charged it) or 'released' (the release policy), until a
    late settle or release resolves it."""

    reservation_id: str
    state: ReservationState
    reserved_micros: int
    expires_at_ms: int
    model: str
    price_version: str
    charged_micros: int | None
    outcome: str


@dataclass(frozen=True)
class KeyRecord:
    """An API key as stored: only the hash of the secret is kept."""

    key_id: str
    key_hash: str
    budget_id: BudgetId
    run_ceiling_micros: int | None


@dataclass(frozen=True)
class Probe:
    """What a store measured about its ledger, for health. Never raises; failures are fields."""

    backend: str
    shared: bool
    reachable: bool
    latency_ms: float | None
    ledger_id: str | None
    durable: bool | None
    reasons: tuple[str, ...]
    instances_seen: int | None


class LedgerStore(Protocol):
    backend: str
    shared: bool

    @property
    def replies(self) -> ReplyStore:
        """The gateway's idempotency keys (core/replies.py), kept beside the ledger they guard."""
        ...

    async def open(self) -> str:
        """Connect, learn (or on an empty ledger, create) the ledger id, and return it."""
        ...

    async def put_budget(self, budget: BudgetDef) -> None: ...

    async def get_budget(self, budget_id: BudgetId) -> BudgetDef | None: ...

    async def status(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None = None
    ) -> tuple[LegStatus, ...]: ...

    async def reserve(self, request: ReserveRequest) -> Reservation: ...

    async def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement: ...

    async def release(self, ref: ReservationRef) -> Release: ...

    async def book(self, request: ReserveRequest, actual_micros: int, admitted_at_ms: int) -> bool:
        """Book spend admitted during an outage, unconditionally, in the periods of
        `admitted_at_ms`; idempotent by reservation id. Returns False if it was booked before."""
        ...

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        """The stored reservation, or None if unknown or another owner's."""
        ...

    async def expire(self, tag: str, batch_max: int) -> int:
        """Resolve up to batch_max expired leases of one tag; return how many."""
        ...

    async def observe_output(self, model: str, output_tokens: int) -> None:
        """Count one call's output length for its model (core/output_stats.py)."""
        ...

    async def output_histogram(self, model: str) -> dict[int, int]:
        """Bucket bound -> count of recent output lengths of this model."""
        ...

    async def put_key(self, record: KeyRecord) -> None: ...

    async def get_key(self, key_hash: str) -> KeyRecord | None: ...

    async def delete_key(self, key_id: str) -> bool: ...

    async def probe(self, instance_id: str) -> Probe: ...

    async def close(self) -> None: ...


def refusal(kind: str, leg: LegStatus, now_ms: int) -> BudgetRefused:
    """The error for a refused reservation, naming the budget and period that refused it."""
    details: dict[str, object] = {
        "budget_id": leg.budget_id,
        "period": leg.period.value,
        "ceiling_micros": leg.ceiling_micros,
        "committed_micros": leg.committed_micros,
        "reserved_micros": leg.reserved_micros,
        "remaining_micros": leg.remaining_micros,
    }
    if kind == "busy":
        return BudgetBusy(
            f"budget {leg.budget_id} ({leg.period}) is held by open reservations; "
            "retry when they settle",
            retry_after_s=BUSY_RETRY_AFTER_S,
            **details,
        )
    if leg.resets_at_ms is not None:
        details["retry_after_s"] = max(1, math.ceil((leg.resets_at_ms - now_ms) / 1000))
    return BudgetExceeded(
        f"budget {leg.budget_id} ({leg.period}) has no room left for this call", **details
    )
