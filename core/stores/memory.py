"""MemoryStore: the ledger in one process's memory, for a single replica.

It keeps the same semantics as the lua/ scripts (the conformance suite runs against both) and is
atomic because no operation awaits between reading and writing: on one event loop, each runs to
completion. It is not a test double, and it is not shared: two processes hold two ceilings, so it
reports `shared = False` and the service refuses it unless CEILING_SINGLE_REPLICA=1.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from core import output_stats
from core.budgets import BudgetDef, BudgetId, Period, window_at
from core.errors import (
    BudgetNotFound,
    IdempotencyConflict,
    ReservationNotFound,
    ReservationResolved,
    ensure,
)
from core.ledger import (
    STATE_CODES,
    Correction,
    ExpirePolicy,
    KeyRecord,
    LegStatus,
    Probe,
    Release,
    Reservation,
    ReservationRef,
    ReservationView,
    ReserveRequest,
    RunLimit,
    Settlement,
    refusal,
    resolved_replay,
    tag_digest,
)
from core.limits import RECLAIM_BATCH_MAX, RECORD_RETENTION_MS, RUN_COUNTER_IDLE_MS
from core.replies import MemoryReplies
from core.stores.scripted import Clock

# Records, run counters and histograms dropped per call once their time has passed: bounds the
# work one call inherits, as RECLAIM_BATCH_MAX does for expired leases.
PRUNE_BATCH_MAX = 64

CounterKey = tuple[str, str]


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

    @property
    def key(self) -> CounterKey:
        return self.budget_id, self.window_key


@dataclass
class _Record:
    state: str  # 'o' open, 's' settled, 'r' released, 'x' expired
    fingerprint: str
    owner: str
    amount_micros: int
    expires_at_ms: int
    policy: ExpirePolicy
    legs: tuple[_Leg, ...]
    price_version: str
    model: str
    created_ms: int = 0
    drop_at_ms: int = 0  # when the record is dropped, as Redis' expiry of it would
    actual_micros: int | None = None
    released_micros: int = 0
    overshoot_micros: int = 0
    late: bool = False
    outcome: str = ""
    resolved_ms: int | None = None
    correction: Correction | None = None
    corrected_at_ms: int | None = None

    @property
    def charged_micros(self) -> int:
        """What it charged, as lua/lib.lua charged_of reads it."""
        if self.state == "s":
            return self.actual_micros or 0
        return self.amount_micros if self.state == "x" and self.outcome == "unknown" else 0


@dataclass
class _Tag:
    records: dict[str, _Record] = field(default_factory=dict)
    open_heap: list[tuple[int, str]] = field(default_factory=list)
    drops: list[tuple[int, str]] = field(default_factory=list)  # (drop_at_ms, id), a heap


def _wall_clock() -> int:
    return int(time.time() * 1000)


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
        self._keys: dict[str, KeyRecord] = {}
        self._key_ids: dict[str, str] = {}
        self._tag_map: dict[str, str] = {}
        # Run counters by last write, oldest first; histograms by last observation, likewise.
        self._runs_seen: OrderedDict[CounterKey, int] = OrderedDict()
        self._outputs: OrderedDict[str, tuple[int, dict[int, int]]] = OrderedDict()
        self.replies = MemoryReplies(self._clock)

    async def open(self) -> str:
        return self._ledger_id

    # -- internals -------------------------------------------------------------------

    def _tag(self, tag: str) -> _Tag:
        return self._tags.setdefault(tag, _Tag())

    def _counter(self, leg: _Leg) -> _Counter:
        return self._counters.setdefault(leg.key, _Counter())

    # Run counters: the rules of lua/lib.lua (run_stale, writable, touched).

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
                        w.end_ms if w else None, d.outage_allowance_micros,
                    )
                )
        if run:
            legs.append(_Leg(run.budget_id.path, "total", run.ceiling_micros, None, 0, run=True))
        return tuple(legs)

    def _keep_until(self, t: _Tag, rid: str, rec: _Record, drop_at_ms: int) -> None:
        """Set when a record is dropped, as PEXPIRE does in the scripts."""
        rec.drop_at_ms = drop_at_ms
        heapq.heappush(t.drops, (drop_at_ms, rid))

    def _resolve(self, t: _Tag, rid: str, rec: _Record, now_ms: int) -> None:
        rec.resolved_ms = now_ms
        self._keep_until(t, rid, rec, now_ms + RECORD_RETENTION_MS)

    def _prune(self, t: _Tag, now_ms: int) -> None:
        for _ in range(PRUNE_BATCH_MAX):
            if not t.drops or t.drops[0][0] > now_ms:
                break
            _, rid = heapq.heappop(t.drops)
            rec = t.records.get(rid)
            if rec is not None and rec.drop_at_ms <= now_ms:
                del t.records[rid]
        self._prune_runs(now_ms)

    def _reclaim(self, t: _Tag, now_ms: int, batch_max: int) -> int:
        n = 0
        while t.open_heap and t.open_heap[0][0] <= now_ms and n < batch_max:
            _, rid = heapq.heappop(t.open_heap)
            rec = t.records.get(rid)
            if rec is None or rec.state != "o":
                continue
            for leg in rec.legs:
                if not self._writable(leg, now_ms):
                    continue
                c = self._counter(leg)
                c.reserved -= rec.amount_micros
                if rec.policy is ExpirePolicy.CHARGE:
                    c.committed += rec.amount_micros
                self._touched(leg, now_ms)
            rec.state = "x"
            rec.outcome = "unknown" if rec.policy is ExpirePolicy.CHARGE else "released"
            self._resolve(t, rid, rec, now_ms)
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
            if prior.state != "o":
                raise resolved_replay(
                    ref.reservation_id, STATE_CODES[prior.state], prior.outcome,
                    prior.amount_micros, prior.charged_micros,
                )
            return Reservation(
                ref.reservation_id, prior.amount_micros, prior.expires_at_ms, now_ms, True,
                self._status(prior.legs),
            )
        self._reclaim(t, now_ms, RECLAIM_BATCH_MAX)
        legs = self._legs(request.budget_ids, request.run, now_ms)
        if not legs:
            raise BudgetNotFound(
                "no budget applies to this call", budget_id=request.budget_ids[-1].path
            )
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
        if failing:
            raise refusal("exceeded" if exceeded else "busy", self._status((failing,))[0], now_ms)
        for leg in legs:
            self._counter(leg).reserved += amount
            self._touched(leg, now_ms)
        expires_at_ms = now_ms + request.ttl_ms
        rec = _Record(
            "o", request.fingerprint, ref.owner, amount, expires_at_ms, request.expire_policy,
            legs, request.price_version, request.model, created_ms=now_ms,
        )
        t.records[ref.reservation_id] = rec
        self._keep_until(t, ref.reservation_id, rec, expires_at_ms + RECORD_RETENTION_MS)
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

    def _settle_one(self, t: _Tag, rid: str, rec: _Record, actual_micros: int,
                    outcome: str) -> Settlement:
        """lua/lib.lua settle_one: an open or expired reservation, settled at actual_micros."""
        now_ms = self._clock()
        amount = rec.amount_micros
        held, committed_delta, reserved_delta = amount, actual_micros, -amount
        late = rec.state == "x"
        if late:
            reserved_delta = 0
            if rec.policy is ExpirePolicy.CHARGE:
                committed_delta = actual_micros - amount
            else:
                held = 0
        overshoot = max(0, actual_micros - held)
        for leg in rec.legs:
            if not self._writable(leg, now_ms):
                continue
            c = self._counter(leg)
            c.reserved += reserved_delta
            c.committed += committed_delta
            c.overshoot += overshoot
            self._touched(leg, now_ms)
        rec.state, rec.actual_micros, rec.late, rec.outcome = "s", actual_micros, late, outcome
        rec.released_micros, rec.overshoot_micros = max(0, held - actual_micros), overshoot
        self._resolve(t, rid, rec, now_ms)
        return Settlement(actual_micros, rec.released_micros, overshoot, late, False)

    async def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement:
        t, rec = self._record(ref)
        if rec.state == "s":
            if rec.actual_micros != actual_micros:
                raise IdempotencyConflict(
                    "this reservation was settled before with another amount",
                    reservation_id=ref.reservation_id,
                )
            return Settlement(
                actual_micros, rec.released_micros, rec.overshoot_micros, rec.late, True
            )
        if rec.state == "r":
            raise ReservationResolved(
                "this reservation was released; it cannot be settled",
                reservation_id=ref.reservation_id,
            )
        return self._settle_one(t, ref.reservation_id, rec, actual_micros, "settled")

    async def release(self, ref: ReservationRef) -> Release:
        t, rec = self._record(ref)
        if rec.state == "s":
            raise ReservationResolved(
                "this reservation was settled; it cannot be released",
                reservation_id=ref.reservation_id,
            )
        if rec.state == "r":
            return Release(rec.released_micros, True)
        now_ms = self._clock()
        released = rec.amount_micros
        for leg in rec.legs:
            if not self._writable(leg, now_ms):
                continue
            c = self._counter(leg)
            if rec.state == "o":
                c.reserved -= rec.amount_micros
            elif rec.policy is ExpirePolicy.CHARGE:
                c.committed -= rec.amount_micros
            self._touched(leg, now_ms)
        if rec.state == "x" and rec.policy is not ExpirePolicy.CHARGE:
            released = 0
        rec.state, rec.released_micros, rec.outcome = "r", released, "released"
        self._resolve(t, ref.reservation_id, rec, now_ms)
        return Release(released, False)

    async def correct(
        self, tag: str, reservation_id: str, actual_micros: int, correction: Correction
    ) -> Settlement:
        t = self._tag(tag)
        self._prune(t, self._clock())
        rec = t.records.get(reservation_id)
        if rec is None:
            raise ReservationNotFound("no such reservation", reservation_id=reservation_id)
        if rec.state == "s" and rec.correction is not None:
            if rec.actual_micros != actual_micros:
                raise IdempotencyConflict(
                    "this reservation was corrected before to another amount",
                    reservation_id=reservation_id,
                )
            return Settlement(
                actual_micros, rec.released_micros, rec.overshoot_micros, rec.late, True
            )
        if rec.state != "o" and not (rec.state == "x" and rec.outcome == "unknown"):
            raise resolved_replay(
                reservation_id, STATE_CODES[rec.state], rec.outcome, rec.amount_micros,
                rec.charged_micros,
            )
        settled = self._settle_one(t, reservation_id, rec, actual_micros, "corrected")
        rec.correction, rec.corrected_at_ms = correction, rec.resolved_ms
        return settled

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
        for leg in legs:
            if leg.run and self._run_stale(leg, now_ms):
                self._drop_run(leg.key)
            c = self._counter(leg)
            c.committed += actual_micros
            c.overshoot += actual_micros
            self._touched(leg, now_ms)
        rec = _Record(
            "s", request.fingerprint, ref.owner, request.amount_micros, admitted_at_ms,
            ExpirePolicy.CHARGE, legs, request.price_version, request.model,
            created_ms=admitted_at_ms, actual_micros=actual_micros,
            overshoot_micros=actual_micros, late=True, outcome="journal",
        )
        t.records[ref.reservation_id] = rec
        self._resolve(t, ref.reservation_id, rec, now_ms)
        return True

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        t = self._tag(ref.tag)
        self._prune(t, self._clock())
        rec = t.records.get(ref.reservation_id)
        if rec is None or rec.owner != ref.owner:
            return None
        return ReservationView(
            ref.reservation_id, STATE_CODES[rec.state], rec.amount_micros, rec.expires_at_ms,
            rec.model, rec.price_version, rec.actual_micros, rec.outcome,
        )

    async def inspect(self, tag: str, reservation_id: str) -> ReservationView | None:
        t = self._tag(tag)
        self._prune(t, self._clock())
        rec = t.records.get(reservation_id)
        if rec is None:
            return None
        fix = rec.correction
        return ReservationView(
            reservation_id, STATE_CODES[rec.state], rec.amount_micros, rec.expires_at_ms,
            rec.model, rec.price_version, rec.actual_micros, rec.outcome, rec.owner,
            rec.created_ms, rec.resolved_ms, fix.corrected_by if fix else None,
            rec.corrected_at_ms, rec.amount_micros if fix else None, fix.reason if fix else None,
        )

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
        return self._defs.get(budget_id.path)

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
        key, now_ms = output_stats.model_key(model), self._clock()
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
        return dict(self._histogram(output_stats.model_key(model), self._clock()) or {})

    async def put_key(self, record: KeyRecord) -> None:
        self._keys[record.key_hash] = record
        self._key_ids[record.key_id] = record.key_hash

    async def get_key(self, key_hash: str) -> KeyRecord | None:
        return self._keys.get(key_hash)

    async def delete_key(self, key_id: str) -> bool:
        key_hash = self._key_ids.pop(key_id, None)
        if key_hash is None:
            return False
        del self._keys[key_hash]
        return True

    async def probe(self, instance_id: str) -> Probe:
        return Probe(
            self.backend, False, True, 0.0, self._ledger_id, False,
            ("ledger_not_shared", "ledger_not_durable"), 1,
        )

    async def close(self) -> None:
        return None
