"""The ledger's vocabulary and the protocols every store implements.

A store holds budgets, API-key records and reservations, and runs the four ledger operations
atomically: reserve, settle, release, expire (each step of a reservation as core/lifecycle.py's
table says). Beside the ledger it keeps the gateway's idempotency keys (ReplyStore). Its
interface is split by what callers need (Ledger, BudgetCatalogue, KeyStore, AlertOutbox,
OutputStats, Health, Reconciliation); LedgerStore is all of them, what every store
implements. The conformance suite (tests/core/stores) is the definition of a store; every store
runs the lua/ scripts (core/stores/scripted.py), the in-memory one on a Redis in its own
process.

Invariant, for every counter (one budget in one period window):
    committed + reserved <= ceiling + overshoot
where overshoot is what settles charged beyond what was held for them.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple, Protocol

from core.alerts import AlertEvent
from core.budgets import USER_SCOPE_KIND, BudgetDef, BudgetId, Period, period_of
from core.errors import (
    BudgetBusy,
    BudgetExceeded,
    BudgetRefused,
    InvalidRequest,
    ReservationResolved,
    ensure,
)
from core.limits import IDEMPOTENCY_WINDOW_MS, RESEND_WINDOW_MS

# A busy budget frees up when an open call settles, which takes seconds, not a lease's length.
BUSY_RETRY_AFTER_S = 1
# Reservation ids begin with this many hex digits of a digest of their tag, so an operator who has
# only an id (from a gateway answer's x-ceiling-reservation-id) can find its tag, and so its keys,
# without a scan: 64 bits, so that two of a million tags share a digest with a chance of about
# one in 10**7 (put_budget refuses the second of two that do).
TAG_DIGEST_HEX = 16
# Tags whose digest a process remembers; tags are the top scopes of admin-made budgets.
TAG_DIGEST_CACHE_MAX = 10_000
_MINTED_ID = re.compile(rf"([0-9a-f]{{{TAG_DIGEST_HEX}}})_[0-9a-f]{{32}}")
# The owner of every reservation the gateway makes is its key id in this namespace. API key ids
# are 'key_<hex>' and a sidecar call acts as its key id, so no API key can present this owner:
# a gateway reservation cannot be settled, released or read through the sidecar routes, by its
# own key or any other. Only the gateway and an operator (core.ledger.Correction) resolve it.
GATEWAY_OWNER_PREFIX = "gw:"


class Role(StrEnum):
    """What an API key may do.

    gateway: the OpenAI-compatible routes, where the service calls the provider and reads the
    bill itself. sidecar: reserve / settle / release, for trusted code that calls the provider
    itself and reports its own usage."""

    GATEWAY = "gateway"
    SIDECAR = "sidecar"


# A key made without roles gets the gateway's: the one role whose charges the key holder cannot
# report for itself.
ROLES_DEFAULT = frozenset({Role.GATEWAY})


@lru_cache(maxsize=TAG_DIGEST_CACHE_MAX)
def tag_digest(tag: str) -> str:
    """The digest of a tag that begins every reservation id minted under it."""
    return hashlib.sha256(tag.encode()).hexdigest()[:TAG_DIGEST_HEX]


def mint_reservation_id(tag: str, unique_hex: str) -> str:
    """A reservation id: the tag's digest, then 128 bits that make it unique (32 hex digits)."""
    return f"{tag_digest(tag)}_{unique_hex}"


def tag_digest_of(reservation_id: str) -> str | None:
    """The tag digest an id was minted with (mint_reservation_id); None for an id of another
    shape, which names no tag."""
    found = _MINTED_ID.fullmatch(reservation_id)
    return found.group(1) if found else None


class Upstream(StrEnum):
    """Whose bill a gateway call is on: the provider whose cost report it is reconciled with
    (core/reconcile.py)."""

    OPENAI = "openai"  # the OpenAI-compatible routes: chat completions and Responses
    ANTHROPIC = "anthropic"  # Messages
    GOOGLE = "google"  # the Gemini API and Vertex AI (genai-prices' provider id for Gemini)
    # Named upstreams' clouds (core/upstream_kinds, UpstreamKind.bill), which no cost report
    # here reads: their spend is counted apart, so it never passes for OpenAI's or Anthropic's.
    AWS = "aws"  # Bedrock
    AZURE = "azure"  # Azure OpenAI
    OTHER = "other"  # any other OpenAI-compatible provider (OpenRouter, Groq, a local vLLM)
    # A sidecar reservation of an amount: no provider is known, so its spend may be on any bill,
    # and reconcile takes it off every provider's unseen spend (core/reconcile.py).
    UNATTRIBUTED = "unattributed"


def bill_of_prices(provider: str | None) -> Upstream:
    """The bill of a call priced by genai-prices' `provider` and no upstream: that provider's
    where it is one of the bills, else OTHER (no report here reads it)."""
    try:
        bill = Upstream(provider or Upstream.OTHER)
    except ValueError:
        return Upstream.OTHER
    return Upstream.OTHER if bill is Upstream.UNATTRIBUTED else bill


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
    """One call's hold. `retention_ms`: how long its record answers a repeat once it is resolved
    (core/limits.py): RESEND_WINDOW_MS for a call only the gateway settles, under an id minted for
    it (no fingerprint: nothing but a resend of the same script can repeat it); REPLAY_WINDOW_MS
    for a sidecar's under a minted id, whose caller may resend a settle or release; the
    idempotency window for one named by an Idempotency-Key, whose caller may replay it."""

    ref: ReservationRef
    budget_ids: tuple[BudgetId, ...]
    amount_micros: int
    ttl_ms: int
    fingerprint: str
    price_version: str
    model: str = ""
    expire_policy: ExpirePolicy = ExpirePolicy.CHARGE
    run: RunLimit | None = None
    retention_ms: int = IDEMPOTENCY_WINDOW_MS
    user: str | None = None  # the call's end user (core/budgets.py check_user)
    # The priced model's one name (core/prices PriceTable.model_name), which budgets' models.allow
    # and per_model name; '' for a call priced by its caller, which names no model.
    canonical_model: str = ""
    # Whose bill the call is on, the day counter its charges are counted in (None: none, as a
    # reservation made before reservations named one).
    bill: Upstream | None = None

    def __post_init__(self) -> None:
        ensure(self.retention_ms > RESEND_WINDOW_MS or not self.fingerprint,
               "a reservation kept only for resends is under an id minted for it: no fingerprint")


# The window key of the legs the outage journal reports (core/outage.py): an instance's own
# allowance while the ledger is unreachable, not a period of the budget.
OUTAGE_WINDOW_KEY = "outage"


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
    """Where a reservation is in its lifecycle (core/lifecycle.py); stored by these names."""

    OPEN = "open"
    SETTLED = "settled"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True)
class ReservationView:
    """A reservation as stored. `outcome` (core.lifecycle.Outcome): '' while open; 'settled',
    'released' or 'corrected' (an operator settled it); 'journal' for spend booked after an
    outage; for a lease that expired, 'unknown' (expiry charged it) or 'released' (the release
    policy), until a late settle, release or correction resolves it. The fields after `outcome`
    are filled for an operator (Ledger.inspect); the owner-checked read leaves them at their
    defaults. A gateway call's record keeps only what a resend needs once it is resolved: its
    expiry, model and price version then read as None and ''."""

    reservation_id: str
    state: ReservationState
    reserved_micros: int
    expires_at_ms: int | None
    model: str
    price_version: str
    charged_micros: int | None
    outcome: str
    owner: str = ""
    created_ms: int | None = None
    resolved_ms: int | None = None
    corrected_by: str | None = None
    corrected_at_ms: int | None = None
    corrected_from_micros: int | None = None
    correction_reason: str | None = None


@dataclass(frozen=True)
class Correction:
    """An operator's settle of a reservation no API key may settle: who, and why.

    `corrected_by` is a fingerprint of the credential that made it, never the credential."""

    corrected_by: str
    reason: str


@dataclass(frozen=True)
class KeyRecord:
    """An API key as it is made, or as a secret was found to be one of it: `key_hash` is the hash
    of that secret (the secret itself is never stored). The ledger keeps one record per key id
    (core/stores/keys.py api_key_record), which names the secrets it takes: the current one, and
    after a rotation the previous one until its grace ends."""

    key_id: str
    key_hash: str
    budget_id: BudgetId
    run_ceiling_micros: int | None
    roles: frozenset[Role] = ROLES_DEFAULT


@dataclass(frozen=True)
class KeyInfo:
    """What a list of keys shows: never the secret, nor its hash."""

    key_id: str
    budget_id: str
    roles: tuple[str, ...]
    run_ceiling_micros: int | None
    created_ms: int | None
    last_used_ms: int | None
    rotated_at_ms: int | None
    previous_valid_ms: int | None  # how long a rotated key's previous secret still works


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


@dataclass(frozen=True)
class OpenHold:
    """One open reservation as an operator lists it (the spend page): who holds how much in
    which budgets, since when and until when. `owner` is the key id it was made under (a
    gateway call's with GATEWAY_OWNER_PREFIX), never a secret; `run_budget_id` the run it
    holds in, if any."""

    reservation_id: str
    owner: str
    budget_ids: tuple[str, ...]
    run_budget_id: str | None
    reserved_micros: int
    created_ms: int | None
    expires_at_ms: int


@dataclass(frozen=True)
class RunSpend:
    """A run's counter as the ledger keeps it: its budget id (the key's budget, then
    '/run:<id>'), the ceiling its open call holds it under, and its spend."""

    budget_id: str
    ceiling_micros: int
    committed_micros: int
    reserved_micros: int
    seen_ms: int | None


@dataclass(frozen=True)
class UserSpend:
    """One end user of a budget with per_user limits, as the ledger counts it: its id, its
    budget id ('<budget>/user:<id>', core/budgets.py BudgetId.user) and the legs of its per_user
    limits now, as a status read naming that user shows them (none once the budget has no
    per_user limits)."""

    user: str
    budget_id: str
    legs: tuple[LegStatus, ...]


@dataclass(frozen=True)
class UsersPage:
    """Some of a budget's end users, in byte order of their ids: `users_count` how many the
    budget counts in all, `more` whether any follow the last of `users`."""

    users: tuple[UserSpend, ...]
    users_count: int
    more: bool


@dataclass(frozen=True)
class OpenLeases:
    """A tag's open reservations as one read sees them at `now_ms`: how many, how many are past
    their lease (an unknown outcome: held in full until expiry books them by their policy), the
    first `listed_max` of each kind by lease end (the most at risk first), and the live runs
    those open calls hold in (Ledger.open_listing says which calls are looked at)."""

    tag: str
    now_ms: int
    open_count: int
    overdue_count: int
    overdue: tuple[OpenHold, ...]
    within_lease: tuple[OpenHold, ...]
    runs: tuple[RunSpend, ...]


# -- the gateway's idempotency keys ----------------------------------------------------------


@dataclass(frozen=True)
class ReplyRef:
    """One idempotency key of one API key: the caller's hash tag, a digest of both keys
    (core/replies.py reply_ref), and whose quota it counts in (`owner`, as a gateway call's
    reservation names its owner: GATEWAY_OWNER_PREFIX and the key id)."""

    tag: str
    digest: str
    owner: str


@dataclass(frozen=True)
class StoredReply:
    """A finished call's answer as the client got it: status, the headers to replay, the body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: str


class Kept(StrEnum):
    """What became of an answer given to a ReplyStore to keep."""

    KEPT = "ok"
    LOST = "lost"  # the attempt no longer holds its key: nothing was written
    OVER = "over"  # keeping it would pass the key's quota of kept bytes: nothing was written


class ClaimKind(StrEnum):
    """What a claim of an idempotency key found: the key for this attempt, the call still
    running under another, its answer, or another request under the same key."""

    CLAIMED = "claimed"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Claim:
    kind: ClaimKind
    reply: StoredReply | None = None


class ReplyStore(Protocol):
    """The shared state behind idempotency keys (the workflow is core/replies.py). Every
    operation is atomic and safe to repeat."""

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        """Claim the key for the attempt `token` for `ttl_ms`, or say what became of it."""
        ...

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int,
                       *, counted: bool = True) -> Kept:
        """Keep `reply` for `ttl_ms`, its bytes counted in the key's quota unless `counted` is
        False (a note that the answer was not kept, which the claim's count bounds)."""
        ...

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        """Give the key back if `token` holds it in flight."""
        ...


# -- the store's protocols -------------------------------------------------------------------
#
# Each caller takes the protocols it uses; every store implements them all (LedgerStore). An
# optional capability (the operators' catalogue, core/operations.py Catalogue) is passed to the
# caller that uses it, never found by asking a store what class it is.


class Ledger(Protocol):
    """The reservations and their counters: the four ledger operations, the outage journal's
    booking, and the reads of what a reservation or a budget's windows hold."""

    async def open(self) -> str:
        """Connect, learn (or on an empty ledger, create) the ledger id, and return it;
        LedgerUnavailable (ledger_reset) for a ledger of a format version this one cannot read."""
        ...

    async def close(self) -> None: ...

    async def status(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None = None,
        user: str | None = None, model: str | None = None,
    ) -> tuple[LegStatus, ...]:
        """What the budgets of the path (with `user`, their end user's too; with `model`, a
        model's one name, the legs of their per_model limits of it, or of every model they
        limit for core/budgets.py ALL_MODELS) hold now."""
        ...

    async def reserve(self, request: ReserveRequest) -> Reservation: ...

    async def settle(self, ref: ReservationRef, actual_micros: int,
                     upstream: Upstream | None = None) -> Settlement:
        """`upstream`: whose bill a gateway call is on; its spend is then counted in that
        provider's day (Reconciliation.gateway_spend_by_day)."""
        ...

    async def release(self, ref: ReservationRef) -> Release: ...

    async def book(self, request: ReserveRequest, actual_micros: int, admitted_at_ms: int) -> bool:
        """Book spend admitted during an outage, unconditionally, in the periods of
        `admitted_at_ms`; idempotent by reservation id. Returns False if it was booked before."""
        ...

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        """The stored reservation, or None if unknown or another owner's; LedgerUnavailable
        (ledger_reset) when it is unknown because the ledger that held it is gone."""
        ...

    async def inspect(self, tag: str, reservation_id: str) -> ReservationView | None:
        """An operator's read: the stored reservation whoever owns it, with its correction; as
        reservation() for one the ledger lost."""
        ...

    async def correct(
        self, tag: str, reservation_id: str, actual_micros: int, correction: Correction
    ) -> Settlement:
        """An operator's settle, whoever owns the reservation: allowed while it is open or after
        it expired with outcome 'unknown'; recorded on it (by whom, when, from what, why).
        Repeating it with the same amount returns the first answer; ReservationResolved for any
        other state, IdempotencyConflict for a correction to another amount."""
        ...

    async def tag_of(self, digest: str) -> str | None:
        """The tag whose reservation ids begin with `digest` (written by put_budget)."""
        ...

    async def expire(self, tag: str, batch_max: int) -> int:
        """Resolve up to batch_max expired leases of one tag; return how many."""
        ...

    async def open_listing(self, tag: str, listed_max: int, examined_max: int) -> OpenLeases:
        """The tag's open reservations for an operator, read at one instant and writing nothing:
        counts, up to listed_max past their lease and up to listed_max within it (each by lease
        end, earliest first), and the runs held in by the examined_max open reservations with the
        latest lease ends, each once, a run whose counter went idle (RUN_COUNTER_IDLE_MS) left
        out."""
        ...


class BudgetCatalogue(Protocol):
    """Budget definitions: made, read, resumed after a velocity alarm, listed per tag."""

    async def put_budget(self, budget: BudgetDef) -> None: ...

    async def get_budget(self, budget_id: BudgetId) -> BudgetDef | None: ...

    async def resume(self, budget_id: BudgetId) -> bool:
        """Lift a velocity alarm's pause; False if the budget was not paused."""
        ...

    async def budgets_of(self, tag: str) -> list[str]:
        """The budget ids of a tag (the spend page)."""
        ...

    async def users_of(self, budget_id: BudgetId, after: str | None, count: int) -> UsersPage:
        """Up to `count` of the budget's end users, in byte order of their ids after `after`
        (None: from the first), each with its legs as a status read naming it shows them."""
        ...


class KeyStore(Protocol):
    """API keys' records: made, found by a secret's hash, rotated, revoked."""

    async def put_key(self, record: KeyRecord) -> None:
        """Make a key: its record, under its id, in one step. Safe to repeat (the same secret's
        hash again writes nothing); InvariantBroken if the id holds another key or was revoked
        (ids are minted fresh, so either is a bug)."""
        ...

    async def get_key(self, key_hash: str, key_id: str | None = None) -> KeyRecord | None:
        """The key whose record names `key_hash` now, as its current secret or as its previous
        one before the rotation's grace ends (the ledger's time), with `key_hash` as given;
        None for any other. `key_id` is the one the secret carries (core/service.py
        key_id_of); None for a secret made before secrets carried it, which a Redis ledger
        finds through the entry under its hash (the in-memory ledger never made one)."""
        ...

    async def rotate_key(self, key_id: str, new_hash: str, grace_ms: int) -> bool:
        """In one step, make `new_hash` the key's current secret and the current one its
        previous, taken for `grace_ms` more (0: not at all); the secret that was previous is
        taken no more. Safe to repeat: a `new_hash` the record names already writes nothing.
        False if there is no such key (or it was revoked)."""
        ...

    async def delete_key(self, key_id: str) -> bool:
        """Revoke a key: in one step, no secret of it is taken any more, and its id is never
        made again. False if there was no such key."""
        ...


def invalid_export(why: str) -> InvalidRequest:
    """A ledger export refused whole, before a restore wrote anything of it."""
    return InvalidRequest(f"not a valid ledger export: {why}; nothing was written",
                          field="export")


@dataclass(frozen=True)
class Restored:
    """What a restore wrote under its new ledger id (core/operations.py Catalogue.restore_body):
    how many budgets, counters, end users and keys, and the open reservations of the export it
    charged as unknown with the micro-dollars they held. `previous_ledger_id` is the id it
    replaces (None: the ledger had been reset)."""

    ledger_id: str
    previous_ledger_id: str | None
    budgets: int
    counters: int
    users: int
    keys: int
    charged_count: int
    charged_micros: int


class KeyListing(Protocol):
    """Keys as an operator lists them (the operators' catalogue, core/operations.py)."""

    async def keys_of(self, budget_id: str | None, after: str | None, count: int
                      ) -> list[KeyInfo]:
        """Keys bound to `budget_id` (every key for None), in index order, after `after`."""
        ...


class LedgerTime(Protocol):
    async def ledger_time_ms(self) -> int:
        """The ledger's clock (Redis TIME): the one every lease and retry is timed by."""
        ...


class AlertOutbox(LedgerTime, Protocol):
    """Alert events (core/alerts.py) and the hourly spend they are read beside."""

    async def alert_tags(self) -> list[str]:
        """Every tag with budgets: where alert outboxes can be."""
        ...

    async def claim_alerts(self, tag: str, batch_max: int, lease_ms: int) -> list[AlertEvent]:
        """Up to batch_max due events of a tag's outbox, each held from other deliverers for
        lease_ms."""
        ...

    async def finish_alert(self, event: AlertEvent, outcome: str, attempts: int,
                           next_at_ms: int, last_error: str) -> None:
        """Record an attempt: 'delivered', 'failed' (given up), or 'retry' at next_at_ms."""
        ...

    async def alert_log(self, tag: str, limit: int) -> list[AlertEvent]:
        """The tag's events, newest first, with their delivery."""
        ...

    async def spend_series(self, budget_id: BudgetId, from_hour: int, to_hour: int
                           ) -> list[tuple[int, int]]:
        """(hour index, committed micros booked in it) for the hours in [from_hour, to_hour]
        with spend (core/limits.py SPEND_BUCKET_MS)."""
        ...


@dataclass(frozen=True)
class DriftEvent:
    """A day on which the ledger's gateway spend and a provider's cost report disagree by more
    than the tolerance."""

    provider: Upstream
    day: date  # UTC
    ledger_micros: int
    provider_micros: int


@dataclass(frozen=True)
class UnseenBooked:
    """A booking of a provider's day beyond what the ledger saw (Reconciliation.book_unseen):
    what this call booked (0 when nothing was new), and what is booked for the day so far."""

    booked_now_micros: int
    booked_micros: int


_EPOCH_DAY = date(1970, 1, 1)


def day_index(day: date) -> int:
    """Days since 1970-01-01: how the ledger numbers a UTC day (lua/settle.lua)."""
    return (day - _EPOCH_DAY).days


def day_of_index(index: int) -> date:
    return _EPOCH_DAY + timedelta(days=index)


class Reconciliation(LedgerTime, Protocol):
    """What the ledger counts to be compared with the providers' bills, and its refusals."""

    async def gateway_spend_by_day(self, upstream: Upstream, first_day: date, last_day: date
                                   ) -> dict[date, int]:
        """Committed micros of the gateway calls to `upstream` that a settle booked, by UTC
        day of the call's start, for the days in [first_day, last_day] that have any."""
        ...

    async def emit_drift_alert(self, event: DriftEvent) -> bool:
        """Put one 'ledger.drift' event in the alert outbox, once per provider and day for as
        long as alerts are kept: True when this call put it."""
        ...

    async def refusal_counts(self) -> dict[str, int]:
        """The refusals the ledger's scripts decided, by error code, over the whole ledger."""
        ...

    async def unseen_booked_by_day(self, upstream: Upstream, first_day: date, last_day: date,
                                   tag: str | None = None) -> dict[date, int]:
        """What book_unseen booked so far for `upstream`, by UTC day, in every tag (or in
        `tag`), for the days in [first_day, last_day] that have any."""
        ...

    async def book_unseen(self, budget_id: BudgetId, upstream: Upstream, day: date,
                          unseen_micros: int) -> UnseenBooked:
        """Charge `budget_id` (and every budget on its path, in their current windows) with
        `unseen_micros` (what `upstream` billed on `day` beyond what the ledger saw) less what
        is booked for that day already, in one step that records the new total: once per
        provider and day, a later larger amount books only the difference, never less than
        nothing. A `ledger.unseen_booked` event goes with each booking. BudgetNotFound when the
        budget has no definition. What other tags booked is the caller's to subtract
        (core/reconcile.py, under the booking lease)."""
        ...

    async def take_booking_lease(self, upstream: Upstream, token: str, ttl_ms: int) -> bool:
        """Take the ledger's one lease for booking `upstream`'s unseen spend, for `ttl_ms`,
        under `token`; False if another holds it."""
        ...

    async def end_booking_lease(self, upstream: Upstream, token: str) -> None:
        """Give back the lease taken under `token` (nothing if it is no longer that)."""
        ...

    async def unseen_audited(self, tag: str, upstream: Upstream, days: Sequence[date]
                             ) -> dict[date, int]:
        """The booked total of `tag`'s day that the audit stream has an entry for, per day."""
        ...

    async def audit_unseen_booked(self, tag: str, upstream: Upstream, day: date, was_micros: int,
                                  total_micros: int, fields: dict[str, str], retention_ms: int
                                  ) -> bool:
        """Append the audit entry `fields` for `tag`'s booked total of `day` reaching
        `total_micros`, if the audited total is still `was_micros`: once per total."""
        ...


class OutputStats(Protocol):
    """Output lengths per model, behind the gateway's p95 holds (core/output_stats.py)."""

    async def observe_output(self, model: str, output_tokens: int) -> None:
        """Count one call's output length for its model."""
        ...

    async def output_histogram(self, model: str) -> dict[int, int]:
        """Bucket bound -> count of recent output lengths of this model."""
        ...


class Health(LedgerTime, Protocol):
    backend: str
    shared: bool

    async def probe(self, instance_id: str) -> Probe: ...


class ServiceStore(Ledger, BudgetCatalogue, KeyStore, OutputStats, Protocol):
    """What the call path needs (core/service.py, and core/gateway.py through the service):
    the ledger, the budgets and keys it checks, and the output lengths a p95 hold reads."""


class LedgerStore(ServiceStore, AlertOutbox, Health, Reconciliation, Protocol):
    """A whole store, as every backend implements it and the conformance suite defines it:
    made in one place (core/backends.py) and handed to each caller as the protocols it uses."""

    @property
    def replies(self) -> ReplyStore:
        """The gateway's idempotency keys, kept beside the ledger they guard."""
        ...


def is_user_leg(leg: LegStatus, user: str) -> bool:
    """Whether a leg is of the end user `user`'s budget (core/budgets.py BudgetId.user)."""
    return leg.budget_id.endswith(f"/{USER_SCOPE_KIND}:{user}")


def user_remaining_micros(legs: tuple[LegStatus, ...], user: str | None) -> int | None:
    """The room the tightest of the end user's legs has; None without a user or user legs."""
    if user is None:
        return None
    return min((leg.remaining_micros for leg in legs if is_user_leg(leg, user)), default=None)


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


def resolved_replay(
    reservation_id: str, state: ReservationState, outcome: str, reserved_micros: int,
    charged_micros: int,
) -> ReservationResolved:
    """The answer to a replayed reserve whose reservation is no longer open.

    Never the hold again: a client that replays a reserve (a retry after a lost answer, a worker
    that restarted) must not take a hold that was settled, released or expired for a budget it
    may call the provider against. It learns what became of it instead."""
    return ReservationResolved(
        f"this reservation was {state.value}"
        + (f" (outcome {outcome})" if outcome and outcome != state.value else "")
        + "; it holds nothing. Use a new Idempotency-Key for a new call",
        reservation_id=reservation_id,
        state=state.value,
        outcome=outcome,
        reserved_micros=reserved_micros,
        charged_micros=charged_micros,
    )
