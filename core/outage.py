"""The outage allowance: what an instance may admit while the shared ledger is unreachable.

Fail closed is the rule. A budget may opt out of it with `outage_allowance_micros`: while the
ledger cannot be reached, each instance admits calls against that allowance, using the budget
definitions it last read, and keeps a journal of what it admitted. When the ledger answers again
the journal is booked into it (lua/book.lua), so nothing is lost.

A budget whose outage_policy is `open` has an allowance no spend reaches
(core/budgets.py OUTAGE_OPEN_ALLOWANCE_MICROS): it admits without limit during an outage, still
journaled and booked afterwards, and still bounded by JOURNAL_ENTRIES_MAX per instance, past
which it fails closed. Health lists the budgets this instance knows as `open`.

The price: every instance has its own allowance, so during an outage spend can exceed the
ceiling by up to allowance x instances. The journal lives in the instance's memory; an instance
that dies during the outage loses its journal, and the provider's bill is then the only record
of what it admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from core.budgets import OUTAGE_OPEN_ALLOWANCE_MICROS, BudgetId
from core.errors import CeilingError, LedgerUnavailable
from core.ledger import (
    OUTAGE_WINDOW_KEY,
    ExpirePolicy,
    Ledger,
    LegStatus,
    Release,
    Reservation,
    ReservationRef,
    ReservationState,
    ReserveRequest,
    Settlement,
    resolved_replay,
)
from core.lifecycle import ABSENT, Effects, Event, effects

# Budget paths whose allowances an instance remembers; bounded because paths come from keys.
KNOWN_PATHS_MAX = 50_000
# Journal entries one instance keeps; past this it fails closed even within its allowance,
# because an unbounded journal is unbounded memory.
JOURNAL_ENTRIES_MAX = 100_000


@dataclass
class JournalEntry:
    """A call admitted during the outage, and the step that resolved it (core/lifecycle.py)."""

    request: ReserveRequest
    admitted_at_ms: int
    state: ReservationState = ReservationState.OPEN
    resolved: Effects | None = None


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


class OutageAllowance:
    def __init__(self, clock: Callable[[], int] = _wall_clock_ms) -> None:
        self._clock = clock
        self._allowances: dict[tuple[str, ...], dict[str, int]] = {}
        # What each budget has admitted against its allowance: holds and spend alike.
        self._admitted: dict[str, int] = {}
        self._journal: dict[tuple[str, str], JournalEntry] = {}

    @property
    def journal_size(self) -> int:
        return len(self._journal)

    def open_budgets(self, count_max: int) -> list[str]:
        """Budgets whose outage policy is `open`, as this instance last read them: the ones that
        would admit without limit if the ledger went away now (health lists them)."""
        found = sorted({b for allowances in self._allowances.values()
                        for b, a in allowances.items() if a >= OUTAGE_OPEN_ALLOWANCE_MICROS})
        return found[:count_max]

    def learn(self, budget_ids: tuple[BudgetId, ...], legs: tuple[LegStatus, ...]) -> None:
        """Remember which budgets applied to this path and their allowances, as last read."""
        path = tuple(b.path for b in budget_ids)
        if path not in self._allowances and len(self._allowances) >= KNOWN_PATHS_MAX:
            self._allowances.clear()
        # A run budget has no allowance of its own: during an outage the allowances of the
        # budgets above it bound the run's spend.
        self._allowances[path] = {
            leg.budget_id: leg.outage_allowance_micros for leg in legs if leg.budget_id in path
        }

    def _book(self, request: ReserveRequest, fx: Effects) -> None:
        """A step's effects on the allowances of the budgets its call was admitted under."""
        delta = fx.reserved_delta + fx.committed_delta
        for budget_id in self._allowances.get(tuple(b.path for b in request.budget_ids), {}):
            self._admitted[budget_id] = self._admitted.get(budget_id, 0) + delta

    def admit(self, request: ReserveRequest, cause: LedgerUnavailable) -> Reservation:
        """Admit against the allowances, or re-raise `cause`: fail closed."""
        allowances = self._allowances.get(tuple(b.path for b in request.budget_ids))
        amount = request.amount_micros
        if (
            not allowances
            or len(self._journal) >= JOURNAL_ENTRIES_MAX
            or any(self._admitted.get(b, 0) + amount > a for b, a in allowances.items())
        ):
            raise cause
        key = (request.ref.tag, request.ref.reservation_id)
        now_ms = self._clock()
        known = self._journal.get(key)
        if known is not None and known.resolved is not None:
            # A replay of a call this instance already resolved: what became of it, as the
            # ledger answers a replay of a resolved reservation.
            raise resolved_replay(
                request.ref.reservation_id, known.state, known.resolved.outcome, amount,
                known.resolved.charged_micros,
            )
        if known is None:
            self._book(request, effects(Event.RESERVE, ABSENT, request.expire_policy, amount))
            known = self._journal[key] = JournalEntry(request, now_ms)
        legs = tuple(
            LegStatus(b, OUTAGE_WINDOW_KEY, a, 0, self._admitted[b], 0, None, a)
            for b, a in allowances.items()
        )
        return Reservation(
            request.ref.reservation_id, amount, known.admitted_at_ms + request.ttl_ms, now_ms,
            known.admitted_at_ms != now_ms, legs,
        )

    def _entry(self, ref: ReservationRef) -> JournalEntry | None:
        entry = self._journal.get((ref.tag, ref.reservation_id))
        return None if entry is None or entry.request.ref.owner != ref.owner else entry

    def _resolve(self, entry: JournalEntry, event: Event, actual_micros: int) -> Effects:
        request = entry.request
        fx = effects(event, entry.state, request.expire_policy, request.amount_micros,
                     actual_micros)
        self._book(request, fx)
        entry.state, entry.resolved = fx.to, fx
        return fx

    def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement | None:
        """Settle a call admitted during the outage, locally; None if it was not (or was
        released, which the ledger answers for)."""
        entry = self._entry(ref)
        if entry is None or entry.state is ReservationState.RELEASED:
            return None
        replayed = entry.resolved is not None
        fx = entry.resolved or self._resolve(entry, Event.SETTLE, actual_micros)
        return Settlement(fx.charged_micros, fx.released_micros, fx.overshoot_micros, fx.late,
                          replayed)

    def release(self, ref: ReservationRef) -> Release | None:
        entry = self._entry(ref)
        if entry is None or entry.state is ReservationState.SETTLED:
            return None
        replayed = entry.resolved is not None
        fx = entry.resolved or self._resolve(entry, Event.RELEASE, 0)
        return Release(fx.released_micros, replayed)

    async def flush(self, store: Ledger) -> int:
        """Book every finished journal entry into the ledger; return how many were booked.

        An entry still open is booked once its lease has run out at what the ledger's 'charge'
        expiry charges, whatever its policy: the worker may have been billed, and nothing here
        can learn otherwise.
        """
        booked = 0
        now_ms = self._clock()
        for key, entry in list(self._journal.items()):
            if entry.state is ReservationState.RELEASED:
                del self._journal[key]
                continue
            request = entry.request
            if entry.resolved is not None:
                actual = entry.resolved.charged_micros
            elif now_ms >= entry.admitted_at_ms + request.ttl_ms:
                actual = effects(Event.EXPIRE, entry.state, ExpirePolicy.CHARGE,
                                 request.amount_micros).charged_micros
            else:
                continue
            try:
                await store.book(request, actual, entry.admitted_at_ms)
            except CeilingError:
                return booked  # still unreachable, or refused: keep the entry, try again later
            del self._journal[key]
            booked += 1
        if not self._journal:
            self._admitted.clear()
        return booked
