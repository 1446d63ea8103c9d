"""MemoryStore: the ledger in one process's memory, for a single replica.

It keeps the same semantics as the lua/ scripts (the conformance suite runs against both) and is
atomic because no operation awaits between reading and writing: on one event loop, each runs to
completion. It is not a test double, and it is not shared: two processes hold two ceilings, so it
reports `shared = False` and the service refuses it unless CEILING_SINGLE_REPLICA=1.
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from core import output_stats
from core.alerts import AlertEvent
from core.budgets import BudgetDef, BudgetId, Period, window_at
from core.errors import (
    BudgetNotFound,
    BudgetPaused,
    IdempotencyConflict,
    ReservationNotFound,
    ReservationResolved,
    ensure,
    state_quota,
)
from core.ledger import (
    Claim,
    ClaimKind,
    Correction,
    ExpirePolicy,
    Kept,
    KeyRecord,
    LegStatus,
    OpenHold,
    OpenLeases,
    Probe,
    Release,
    ReplyRef,
    Reservation,
    ReservationRef,
    ReservationState,
    ReservationView,
    ReserveRequest,
    RunLimit,
    RunSpend,
    Settlement,
    StoredReply,
    refusal,
    resolved_replay,
    tag_digest,
)
from core.lifecycle import ABSENT, Effects, Event, Outcome, charged_micros, effects, step
from core.limits import (
    IDEMPOTENCY_WINDOW_MS,
    RECLAIM_BATCH_MAX,
    RECORDS_KEPT_PER_KEY_MAX,
    REPLAY_WINDOW_MS,
    REPLIES_PER_KEY_MAX,
    REPLY_BYTES_PER_KEY_MAX,
    RESEND_WINDOW_MS,
    RUN_COUNTER_IDLE_MS,
    RUNS_PER_KEY_MAX,
    STATE_QUOTA_WINDOW_MS,
    UNKNOWN_OUTCOME_RETENTION_MS,
)
from core.stores.memory_alerts import MemoryAlerts
from core.stores.scripted import Clock

# Records, run counters and histograms dropped per call once their time has passed: bounds the
# work one call inherits, as RECLAIM_BATCH_MAX does for expired leases.
PRUNE_BATCH_MAX = 64

CounterKey = tuple[str, str]
_OPEN, _SETTLED = ReservationState.OPEN, ReservationState.SETTLED
_RELEASED, _EXPIRED = ReservationState.RELEASED, ReservationState.EXPIRED


@dataclass
class _Counter:
    committed: int = 0
    reserved: int = 0
    overshoot: int = 0


@dataclass(frozen=True)
class _Leg:
    budget_id: str
    window_key: str
    ceiling_micros: int
    resets_at_ms: int | None
    outage_allowance_micros: int
    run: bool = False
    # A velocity alarm watched its budget when it was held (lua/lib.lua parse_legs).
    velocity: bool = False

    @property
    def key(self) -> CounterKey:
        return self.budget_id, self.window_key


@dataclass
class _Record:
    state: ReservationState
    fingerprint: str
    owner: str
    reserved_micros: int
    expires_at_ms: int
    expire_policy: ExpirePolicy
    legs: tuple[_Leg, ...]
    price_version: str
    model: str
    retention_ms: int
    created_ms: int = 0
    drop_at_ms: int = 0  # when the record is dropped, as Redis' expiry of it would
    actual_micros: int | None = None
    released_micros: int = 0
    overshoot_micros: int = 0
    late: bool = False
    outcome: str = Outcome.NONE
    resolved_ms: int | None = None
    correction: Correction | None = None
    corrected_at_ms: int | None = None

    @property
    def charged_micros(self) -> int:
        return charged_micros(self.state, self.expire_policy, self.reserved_micros,
                              self.actual_micros or 0)

    @property
    def kept_ms(self) -> int:
        """How long it is kept once resolved, as lua/lib.lua keep_resolved_record says."""
        if self.outcome in (Outcome.UNKNOWN, Outcome.CORRECTED):
            return UNKNOWN_OUTCOME_RETENTION_MS
        retention = self.retention_ms
        if retention > REPLAY_WINDOW_MS and self.charged_micros == 0:
            retention = REPLAY_WINDOW_MS  # it moved no money: kept for replays only
        if self.state is _EXPIRED:
            return max(retention, self.expires_at_ms - self.created_ms)
        return retention


@dataclass
class _Quota:
    """What one API key made in one quota window (core/limits.py STATE_QUOTA_WINDOW_MS)."""

    window: int
    records: int = 0
    runs: int = 0
    replies: int = 0
    reply_bytes: int = 0

    def retry_after_s(self, now_ms: int) -> int:
        return -(-((self.window + 1) * STATE_QUOTA_WINDOW_MS - now_ms) // 1_000)


class _Quotas:
    """Each (tag, owner)'s quota in its current window (lua/lib.lua quota_read)."""

    def __init__(self) -> None:
        self._by_owner: dict[tuple[str, str], _Quota] = {}

    def used(self, owner: tuple[str, str], now_ms: int) -> _Quota:
        window = now_ms // STATE_QUOTA_WINDOW_MS
        quota = self._by_owner.get(owner)
        if quota is None or quota.window != window:
            for stale in [k for k, q in self._by_owner.items() if q.window < window - 1][
                    :PRUNE_BATCH_MAX]:
                del self._by_owner[stale]
            quota = self._by_owner[owner] = _Quota(window)
        return quota


@dataclass
class _Tag:
    records: dict[str, _Record] = field(default_factory=dict)
    open_heap: list[tuple[int, str]] = field(default_factory=list)
    drops: list[tuple[int, str]] = field(default_factory=list)  # (drop_at_ms, id), a heap


def _paused(budget_id: str) -> BudgetPaused:
    return BudgetPaused(
        f"budget {budget_id} was paused by its velocity alarm; an operator resumes it "
        "(ceiling budgets resume)", budget_id=budget_id)


def _wall_clock() -> int:
    return int(time.time() * 1000)


def _holds(held: list[tuple[int, str, _Record]]) -> tuple[OpenHold, ...]:
    return tuple(
        OpenHold(rid, rec.owner, tuple(dict.fromkeys(x.budget_id for x in rec.legs if not x.run)),
                 next((x.budget_id for x in rec.legs if x.run), None), rec.reserved_micros,
                 rec.created_ms, rec.expires_at_ms)
        for _, rid, rec in held)


class MemoryStore:
    """A ledger for one process. See core.ledger.LedgerStore for the contract."""

    backend = "memory"
    shared = False

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock = clock or _wall_clock
        self._ledger_id = uuid.uuid4().hex
        self._defs: dict[str, BudgetDef] = {}
        self._counters: dict[tuple[str, str], _Counter] = {}
        self._tags: dict[str, _Tag] = {}
        # Key id -> its record (key_hash: the current secret's), the previous secret's hash ('':
        # none) and when that one's grace ends; as lua/key_put.lua keeps one. Secrets carry their
        # key id, so there is no index of hashes. Revoked ids are never made again.
        self._keys: dict[str, tuple[KeyRecord, str, int]] = {}
        self._revoked_key_ids: set[str] = set()
        self._tag_map: dict[str, str] = {}
        # Run counters by last write, oldest first; histograms by last observation, likewise.
        self._runs_seen: OrderedDict[CounterKey, int] = OrderedDict()
        self._quotas = _Quotas()
        self._outputs: OrderedDict[str, tuple[int, dict[int, int]]] = OrderedDict()
        self.replies = MemoryReplies(self._clock)
        self._alerts = MemoryAlerts(self._clock)

    async def open(self) -> str:
        return self._ledger_id

    # -- internals -------------------------------------------------------------------

    def _tag(self, tag: str) -> _Tag:
        return self._tags.setdefault(tag, _Tag())

    def _counter(self, leg: _Leg) -> _Counter:
        return self._counters.setdefault(leg.key, _Counter())

    # Run counters: the rules of lua/lib.lua (run_stale, writable, touch_run).

    def _run_stale(self, leg: _Leg, now_ms: int) -> bool:
        seen = self._runs_seen.get(leg.key)
        return seen is not None and seen + RUN_COUNTER_IDLE_MS <= now_ms

    def _drop_run(self, key: CounterKey) -> None:
        self._counters.pop(key, None)
        self._runs_seen.pop(key, None)

    def _writable(self, leg: _Leg, now_ms: int) -> bool:
        if not leg.run:
            return True
        if self._run_stale(leg, now_ms):
            self._drop_run(leg.key)
            return False
        return leg.key in self._counters

    def _touched(self, leg: _Leg, now_ms: int) -> None:
        if leg.run:
            self._runs_seen[leg.key] = now_ms
            self._runs_seen.move_to_end(leg.key)

    def _prune_runs(self, now_ms: int) -> None:
        for _ in range(PRUNE_BATCH_MAX):
            oldest = next(iter(self._runs_seen.items()), None)
            if oldest is None or oldest[1] + RUN_COUNTER_IDLE_MS > now_ms:
                return
            self._drop_run(oldest[0])

    def _status(self, legs: tuple[_Leg, ...], now_ms: int | None = None) -> tuple[LegStatus, ...]:
        out = []
        for leg in legs:
            gone = now_ms is not None and leg.run and self._run_stale(leg, now_ms)
            c = _Counter() if gone else self._counters.get(leg.key, _Counter())
            out.append(
                LegStatus(
                    leg.budget_id, leg.window_key, leg.ceiling_micros, c.committed, c.reserved,
                    c.overshoot, leg.resets_at_ms, leg.outage_allowance_micros,
                )
            )
        return tuple(out)

    def _legs(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None, now_ms: int
    ) -> tuple[_Leg, ...]:
        legs: list[_Leg] = []
        for bid in budget_ids:
            d = self._defs.get(bid.path)
            if d is None:
                continue
            for period in Period:
                lim = next((x for x in d.limits if x.period is period), None)
                if lim is None:
                    continue
                w = window_at(d.timezone, period, now_ms)
                legs.append(
                    _Leg(
                        bid.path, w.key if w else "total", lim.ceiling_micros,
                        w.resets_at_ms if w else None, d.ledger_allowance_micros,
                        velocity=d.alerts.velocity is not None,
                    )
                )
        if run:
            legs.append(_Leg(run.budget_id.path, "total", run.ceiling_micros, None, 0, run=True))
        return tuple(legs)

    def _keep_until(self, t: _Tag, rid: str, rec: _Record, drop_at_ms: int) -> None:
        """Set when a record is dropped, as PEXPIRE does in the scripts."""
        rec.drop_at_ms = drop_at_ms
        heapq.heappush(t.drops, (drop_at_ms, rid))

    def _prune(self, t: _Tag, now_ms: int) -> None:
        for _ in range(PRUNE_BATCH_MAX):
            if not t.drops or t.drops[0][0] > now_ms:
                break
            _, rid = heapq.heappop(t.drops)
            rec = t.records.get(rid)
            if rec is not None and rec.drop_at_ms <= now_ms:
                del t.records[rid]
        self._prune_runs(now_ms)

    def _apply(self, legs: tuple[_Leg, ...], fx: Effects, now_ms: int,
               spent_at_ms: int) -> None:
        """Book one step in every leg it may write to (lua/lib.lua apply)."""
        seen = None
        for leg in legs:
            if self._writable(leg, now_ms):
                seen = self._book_in(leg, fx, now_ms, spent_at_ms, seen)

    def _book_in(self, leg: _Leg, fx: Effects, now_ms: int, spent_at_ms: int,
                 seen: str | None) -> str | None:
        """One step's deltas in one leg's counter, and what its committed spend sets off
        (its hourly bucket: the hour of `spent_at_ms`, the call's own time); returns the budget
        whose alerts were looked at (lua/lib.lua: `seen`)."""
        c = self._counter(leg)
        c.reserved += fx.reserved_delta
        c.committed += fx.committed_delta
        c.overshoot += fx.overshoot_micros
        if leg.run and not c.committed and not c.reserved:
            self._drop_run(leg.key)  # nothing spent, nothing open: not kept (lua/lib.lua apply)
            return seen
        self._touched(leg, now_ms)
        if fx.committed_delta and not leg.run:
            self._committed_moved(leg, c.committed, fx.committed_delta, now_ms, spent_at_ms,
                                  seen)
            return leg.budget_id
        return seen

    def _committed_moved(self, leg: _Leg, after: int, delta: int, now_ms: int,
                         spent_at_ms: int, seen: str | None) -> None:
        """Alerts (issue 16): lua/lib.lua committed_moved."""
        d = self._defs.get(leg.budget_id)
        self._alerts.committed_moved(
            d.alerts if d else None, leg.budget_id, leg.window_key, leg.ceiling_micros,
            leg.resets_at_ms, after, delta, now_ms, spent_at_ms, seen != leg.budget_id,
            leg.velocity)

    def _resolve(self, t: _Tag, rid: str, rec: _Record, event: Event, actual_micros: int,
                 now_ms: int) -> Effects:
        """One step that resolves a reservation, as the lifecycle's table says (lua/lib.lua
        resolve)."""
        fx = effects(event, rec.state, rec.expire_policy, rec.reserved_micros, actual_micros)
        self._apply(rec.legs, fx, now_ms, rec.created_ms)
        rec.state, rec.outcome, rec.resolved_ms = fx.to, fx.outcome, now_ms
        if fx.to is _SETTLED:
            rec.actual_micros = actual_micros
        rec.released_micros, rec.overshoot_micros, rec.late = (
            fx.released_micros, fx.overshoot_micros, fx.late)
        self._keep_until(t, rid, rec, now_ms + rec.kept_ms)
        return fx

    def _reclaim(self, t: _Tag, now_ms: int, batch_max: int) -> int:
        n = 0
        while t.open_heap and t.open_heap[0][0] <= now_ms and n < batch_max:
            _, rid = heapq.heappop(t.open_heap)
            rec = t.records.get(rid)
            if rec is None or rec.state is not _OPEN:
                continue
            self._resolve(t, rid, rec, Event.EXPIRE, 0, now_ms)
            n += 1
        return n

    # -- the ledger operations ------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Reservation:
        ref = request.ref
        ensure(all(b.tag == ref.tag for b in request.budget_ids), "one tag per reservation")
        now_ms = self._clock()
        t = self._tag(ref.tag)
        self._prune(t, now_ms)
        prior = t.records.get(ref.reservation_id)
        if prior is not None:
            if prior.fingerprint != request.fingerprint or prior.owner != ref.owner:
                raise IdempotencyConflict(
                    "this reservation id was used with other parameters",
                    reservation_id=ref.reservation_id,
                )
            if prior.state is _OPEN and prior.expires_at_ms <= now_ms:
                # Past its lease and not reclaimed yet: expired here, as lua/reserve.lua does.
                self._resolve(t, ref.reservation_id, prior, Event.EXPIRE, 0, now_ms)
            if prior.state is not _OPEN:
                raise resolved_replay(
                    ref.reservation_id, prior.state, prior.outcome, prior.reserved_micros,
                    prior.charged_micros,
                )
            return Reservation(
                ref.reservation_id, prior.reserved_micros, prior.expires_at_ms, now_ms, True,
                self._status(prior.legs),
            )
        legs = self._legs(request.budget_ids, request.run, now_ms)
        if not legs:
            raise BudgetNotFound(
                "no budget applies to this call", budget_id=request.budget_ids[-1].path
            )
        paused = next((b.path for b in request.budget_ids if b.path in self._alerts.paused),
                      None)
        if paused is not None:
            raise _paused(paused)
        self._reclaim(t, now_ms, RECLAIM_BATCH_MAX)
        amount = request.amount_micros
        exceeded = busy = None
        for leg in legs:
            if leg.run and self._run_stale(leg, now_ms):
                self._drop_run(leg.key)  # an idle run's counter: the run is new
            c = self._counters.get(leg.key, _Counter())
            if c.committed + amount > leg.ceiling_micros:
                exceeded = exceeded or leg
            elif c.committed + c.reserved + amount > leg.ceiling_micros:
                busy = busy or leg
        failing = exceeded or busy
        if exceeded and not exceeded.run:
            self._alerts.refused(  # issue 16: budget.exceeded, once a window
                exceeded.budget_id, exceeded.window_key, exceeded.ceiling_micros,
                self._counters.get(exceeded.key, _Counter()).committed, exceeded.resets_at_ms,
                now_ms)
        if failing:
            raise refusal("exceeded" if exceeded else "busy", self._status((failing,))[0], now_ms)
        # The key's quota of what outlives the call (lua/lib.lua hold).
        kept = request.retention_ms != RESEND_WINDOW_MS
        opens = int(any(leg.run and leg.key not in self._counters for leg in legs))
        quota = None
        if kept or opens:
            quota = self._quotas.used((ref.tag, ref.owner), now_ms)
            over = ("records" if kept and quota.records >= RECORDS_KEPT_PER_KEY_MAX else
                    "runs" if quota.runs + opens > RUNS_PER_KEY_MAX else None)
            if over:
                raise state_quota(over, quota.retry_after_s(now_ms))
            quota.records += kept
            quota.runs += opens
        fx = effects(Event.RESERVE, ABSENT, request.expire_policy, amount)
        for leg in legs:
            self._counter(leg).reserved += fx.reserved_delta
            self._touched(leg, now_ms)
        expires_at_ms = now_ms + request.ttl_ms
        rec = _Record(
            fx.to, request.fingerprint, ref.owner, amount, expires_at_ms, request.expire_policy,
            legs, request.price_version, request.model, request.retention_ms, created_ms=now_ms,
        )
        t.records[ref.reservation_id] = rec
        self._keep_until(t, ref.reservation_id, rec,
                         expires_at_ms + UNKNOWN_OUTCOME_RETENTION_MS)
        heapq.heappush(t.open_heap, (expires_at_ms, ref.reservation_id))
        return Reservation(
            ref.reservation_id, amount, expires_at_ms, now_ms, False, self._status(legs)
        )

    def _record(self, ref: ReservationRef) -> tuple[_Tag, _Record]:
        t = self._tag(ref.tag)
        self._prune(t, self._clock())
        rec = t.records.get(ref.reservation_id)
        if rec is None or rec.owner != ref.owner:
            raise ReservationNotFound("no such reservation", reservation_id=ref.reservation_id)
        return t, rec

    async def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement:
        t, rec = self._record(ref)
        if rec.state is _SETTLED:
            if rec.actual_micros != actual_micros:
                raise IdempotencyConflict(
                    "this reservation was settled before with another amount",
                    reservation_id=ref.reservation_id,
                )
            return Settlement(
                actual_micros, rec.released_micros, rec.overshoot_micros, rec.late, True
            )
        if rec.state is _RELEASED:
            raise ReservationResolved(
                "this reservation was released; it cannot be settled",
                reservation_id=ref.reservation_id,
            )
        fx = self._resolve(t, ref.reservation_id, rec, Event.SETTLE, actual_micros, self._clock())
        return Settlement(fx.charged_micros, fx.released_micros, fx.overshoot_micros, fx.late,
                          False)

    async def release(self, ref: ReservationRef) -> Release:
        t, rec = self._record(ref)
        if rec.state is _SETTLED:
            raise ReservationResolved(
                "this reservation was settled; it cannot be released",
                reservation_id=ref.reservation_id,
            )
        if rec.state is _RELEASED:
            return Release(rec.released_micros, True)
        fx = self._resolve(t, ref.reservation_id, rec, Event.RELEASE, 0, self._clock())
        return Release(fx.released_micros, False)

    async def correct(
        self, tag: str, reservation_id: str, actual_micros: int, correction: Correction
    ) -> Settlement:
        t = self._tag(tag)
        self._prune(t, self._clock())
        rec = t.records.get(reservation_id)
        if rec is None:
            raise ReservationNotFound("no such reservation", reservation_id=reservation_id)
        if rec.state is _SETTLED and rec.correction is not None:
            if rec.actual_micros != actual_micros:
                raise IdempotencyConflict(
                    "this reservation was corrected before to another amount",
                    reservation_id=reservation_id,
                )
            return Settlement(
                actual_micros, rec.released_micros, rec.overshoot_micros, rec.late, True
            )
        if step(Event.CORRECT, rec.state, rec.expire_policy) is None:
            raise resolved_replay(
                reservation_id, rec.state, rec.outcome, rec.reserved_micros, rec.charged_micros,
            )
        rec.correction = correction
        fx = self._resolve(t, reservation_id, rec, Event.CORRECT, actual_micros, self._clock())
        rec.corrected_at_ms = rec.resolved_ms
        return Settlement(fx.charged_micros, fx.released_micros, fx.overshoot_micros, fx.late,
                          False)

    async def book(self, request: ReserveRequest, actual_micros: int, admitted_at_ms: int) -> bool:
        ref = request.ref
        t = self._tag(ref.tag)
        now_ms = self._clock()
        self._prune(t, now_ms)
        if ref.reservation_id in t.records:
            return False
        legs = self._legs(request.budget_ids, request.run, admitted_at_ms)
        if not legs:
            raise BudgetNotFound("no budget applies to this journal entry")
        fx = effects(Event.BOOK, ABSENT, ExpirePolicy.CHARGE, request.amount_micros,
                     actual_micros)
        seen = None
        for leg in legs:
            if leg.run and self._run_stale(leg, now_ms):
                self._drop_run(leg.key)
            # Booked unconditionally (lua/book.lua): the money is spent, a run's too.
            seen = self._book_in(leg, fx, now_ms, admitted_at_ms, seen)
        # Kept for the idempotency window, whatever call it was: a flush retried after a lost
        # reply must find it (lua/book.lua).
        rec = _Record(
            fx.to, request.fingerprint, ref.owner, request.amount_micros, admitted_at_ms,
            ExpirePolicy.CHARGE, legs, request.price_version, request.model,
            IDEMPOTENCY_WINDOW_MS, created_ms=admitted_at_ms, actual_micros=actual_micros,
            released_micros=fx.released_micros, overshoot_micros=fx.overshoot_micros,
            late=fx.late, outcome=fx.outcome, resolved_ms=now_ms,
        )
        t.records[ref.reservation_id] = rec
        self._keep_until(t, ref.reservation_id, rec, now_ms + rec.kept_ms)
        return True

    def _view(self, reservation_id: str, rec: _Record, *, full: bool) -> ReservationView:
        charged = rec.actual_micros if rec.state is _SETTLED else None
        common = (reservation_id, rec.state, rec.reserved_micros, rec.expires_at_ms, rec.model,
                  rec.price_version, charged, rec.outcome)
        if not full:
            return ReservationView(*common)
        fix = rec.correction
        return ReservationView(
            *common, rec.owner, rec.created_ms, rec.resolved_ms,
            fix.corrected_by if fix else None, rec.corrected_at_ms,
            rec.reserved_micros if fix else None, fix.reason if fix else None,
        )

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        t = self._tag(ref.tag)
        self._prune(t, self._clock())
        rec = t.records.get(ref.reservation_id)
        if rec is None or rec.owner != ref.owner:
            return None
        return self._view(ref.reservation_id, rec, full=False)

    async def inspect(self, tag: str, reservation_id: str) -> ReservationView | None:
        t = self._tag(tag)
        self._prune(t, self._clock())
        rec = t.records.get(reservation_id)
        return None if rec is None else self._view(reservation_id, rec, full=True)

    async def tag_of(self, digest: str) -> str | None:
        return self._tag_map.get(digest)

    async def expire(self, tag: str, batch_max: int) -> int:
        t = self._tag(tag)
        self._prune(t, self._clock())
        return self._reclaim(t, self._clock(), batch_max)

    # -- budgets and keys -----------------------------------------------------------------

    async def put_budget(self, budget: BudgetDef) -> None:
        tag = budget.budget_id.tag
        found = self._tag_map.setdefault(tag_digest(tag), tag)
        ensure(found == tag, f"the tags {found!r} and {tag!r} share a reservation-id digest")
        self._defs[budget.budget_id.path] = budget

    async def get_budget(self, budget_id: BudgetId) -> BudgetDef | None:
        found = self._defs.get(budget_id.path)
        paused = self._alerts.paused.get(budget_id.path)
        return found if found is None or paused is None else replace(found, paused_at_ms=paused)

    # -- alerts (issue 16): core/stores/memory_alerts.py ---------------------------------------

    async def resume(self, budget_id: BudgetId) -> bool:
        return self._alerts.paused.pop(budget_id.path, None) is not None

    async def ledger_time_ms(self) -> int:
        return self._clock()

    async def budgets_of(self, tag: str) -> list[str]:
        return sorted(p for p in self._defs if BudgetId(p).tag == tag)

    async def open_listing(self, tag: str, listed_max: int, examined_max: int) -> OpenLeases:
        ensure(listed_max >= 1 and examined_max >= 1, "an open listing lists something")
        now_ms = self._clock()
        # By lease end, then id: the open-lease set's order in Redis.
        held = sorted(((r.expires_at_ms, rid, r) for rid, r in self._tag(tag).records.items()
                       if r.state is _OPEN), key=lambda x: (x[0], x[1]))
        overdue = [h for h in held if h[0] <= now_ms]
        within = [h for h in held if h[0] > now_ms]
        runs: dict[CounterKey, RunSpend] = {}
        for _, _, rec in reversed(held[-examined_max:]):
            for leg in rec.legs:
                c = self._counters.get(leg.key)
                if leg.run and leg.key not in runs and c and not self._run_stale(leg, now_ms):
                    runs[leg.key] = RunSpend(leg.budget_id, leg.ceiling_micros, c.committed,
                                             c.reserved, self._runs_seen.get(leg.key))
        return OpenLeases(tag, now_ms, len(held), len(overdue),
                          _holds(overdue[:listed_max]), _holds(within[:listed_max]),
                          tuple(runs.values()))

    async def alert_tags(self) -> list[str]:
        return sorted(set(self._tag_map.values()))

    async def claim_alerts(self, tag: str, batch_max: int, lease_ms: int) -> list[AlertEvent]:
        return self._alerts.claim(tag, batch_max, lease_ms)

    async def finish_alert(self, event: AlertEvent, outcome: str, attempts: int,
                           next_at_ms: int, last_error: str) -> None:
        self._alerts.finish(event, outcome, attempts, next_at_ms, last_error)

    async def alert_log(self, tag: str, limit: int) -> list[AlertEvent]:
        return self._alerts.log(tag, limit)

    async def spend_series(self, budget_id: BudgetId, from_hour: int, to_hour: int
                           ) -> list[tuple[int, int]]:
        return self._alerts.series(budget_id.path, from_hour, to_hour)

    async def status(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None = None
    ) -> tuple[LegStatus, ...]:
        if not budget_ids:
            return ()
        now_ms = self._clock()
        return self._status(self._legs(budget_ids, run, now_ms), now_ms)

    def _histogram(self, key: str, now_ms: int) -> dict[int, int] | None:
        """A model's histogram, or None once HISTOGRAM_IDLE_MS passed since it was observed."""
        for _ in range(PRUNE_BATCH_MAX):
            oldest = next(iter(self._outputs.items()), None)
            if oldest is None or oldest[1][0] + output_stats.HISTOGRAM_IDLE_MS > now_ms:
                break
            del self._outputs[oldest[0]]
        found = self._outputs.get(key)
        if found is None or found[0] + output_stats.HISTOGRAM_IDLE_MS <= now_ms:
            return None
        return found[1]

    async def observe_output(self, model: str, output_tokens: int) -> None:
        key, now_ms = model.lower(), self._clock()
        histogram = self._histogram(key, now_ms) or {}
        b = output_stats.bucket(output_tokens)
        histogram[b] = histogram.get(b, 0) + 1
        if sum(histogram.values()) > output_stats.OBSERVATIONS_MAX:
            for k in list(histogram):
                histogram[k] //= 2
                if not histogram[k]:
                    del histogram[k]
        self._outputs[key] = (now_ms, histogram)
        self._outputs.move_to_end(key)

    async def output_histogram(self, model: str) -> dict[int, int]:
        return dict(self._histogram(model.lower(), self._clock()) or {})

    async def put_key(self, record: KeyRecord) -> None:
        found = self._keys.get(record.key_id)
        ensure(record.key_id not in self._revoked_key_ids
               and (found is None or found[0].key_hash == record.key_hash),
               f"the key id {record.key_id} was new")
        if found is None:
            self._keys[record.key_id] = (record, "", 0)

    async def get_key(self, key_hash: str, key_id: str | None = None) -> KeyRecord | None:
        # Every secret this ledger made carries its key id (it never held an older one).
        found = None if key_id is None else self._keys.get(key_id)
        if found is None:
            return None
        record, previous_key_hash, grace_ends_at_ms = found
        if key_hash == record.key_hash or (
                key_hash == previous_key_hash and self._clock() < grace_ends_at_ms):
            return replace(record, key_hash=key_hash)
        return None

    async def rotate_key(self, key_id: str, new_hash: str, grace_ms: int) -> bool:
        found = self._keys.get(key_id)
        if found is None:
            return False
        record, previous_key_hash, _ = found
        if new_hash not in (record.key_hash, previous_key_hash):  # else a repeat
            self._keys[key_id] = (replace(record, key_hash=new_hash), record.key_hash,
                                  self._clock() + grace_ms)
        return True

    async def delete_key(self, key_id: str) -> bool:
        self._revoked_key_ids.add(key_id)
        return self._keys.pop(key_id, None) is not None

    async def probe(self, instance_id: str) -> Probe:
        return Probe(
            self.backend, False, True, 0.0, self._ledger_id, False,
            ("ledger_not_shared", "ledger_not_durable"), 1,
        )

    async def close(self) -> None:
        return None


@dataclass
class _Reply:
    fingerprint: str
    token: str
    expires_at_ms: int
    reply: StoredReply | None = None


class MemoryReplies:
    """ReplyStore in one process's memory, beside MemoryStore; same semantics as the scripts.

    Atomic for the same reason MemoryStore is: no operation awaits between reading and writing.
    Expired entries are dropped when their key is next touched, and a bounded batch of them on
    every claim, so memory does not grow with keys nobody retries.
    """

    def __init__(self, clock: Clock = _wall_clock) -> None:
        self._clock = clock
        self._entries: dict[ReplyRef, _Reply] = {}
        self._quotas = _Quotas()

    def _live(self, ref: ReplyRef, now_ms: int) -> _Reply | None:
        entry = self._entries.get(ref)
        if entry is not None and entry.expires_at_ms <= now_ms:
            del self._entries[ref]
            return None
        return entry

    def _prune(self, now_ms: int) -> None:
        expired = [k for k, e in itertools.islice(self._entries.items(), PRUNE_BATCH_MAX)
                   if e.expires_at_ms <= now_ms]
        for ref in expired:
            del self._entries[ref]

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        now_ms = self._clock()
        self._prune(now_ms)
        entry = self._live(ref, now_ms)
        if entry is None:
            quota = self._quotas.used((ref.tag, ref.owner), now_ms)
            if quota.replies >= REPLIES_PER_KEY_MAX:
                raise state_quota("replies", quota.retry_after_s(now_ms))
            quota.replies += 1
            self._entries[ref] = _Reply(fingerprint, token, now_ms + ttl_ms)
            return Claim(ClaimKind.CLAIMED)
        if entry.fingerprint != fingerprint:
            return Claim(ClaimKind.CONFLICT)
        if entry.reply is not None:
            return Claim(ClaimKind.DONE, entry.reply)
        return Claim(ClaimKind.CLAIMED if entry.token == token else ClaimKind.IN_FLIGHT)

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int,
                       *, counted: bool = True) -> Kept:
        now_ms = self._clock()
        entry = self._live(ref, now_ms)
        if entry is None or entry.token != token:
            return Kept.LOST
        if entry.reply is None:
            if counted:  # lua/reply_complete.lua: the headers' JSON and the body, as sent
                quota = self._quotas.used((ref.tag, ref.owner), now_ms)
                size = len(json.dumps(reply.headers).encode()) + len(reply.body.encode())
                if quota.reply_bytes + size > REPLY_BYTES_PER_KEY_MAX:
                    return Kept.OVER
                quota.reply_bytes += size
            entry.reply = reply
            entry.expires_at_ms = now_ms + ttl_ms
        return Kept.KEPT

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        entry = self._live(ref, self._clock())
        if entry is not None and entry.reply is None and entry.token == token:
            del self._entries[ref]
