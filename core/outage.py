"""The outage allowance: what an instance may admit while the shared ledger is unreachable.

Fail closed is the rule. A budget may opt out of it with `outage_allowance_micros`: while the
ledger cannot be reached, each instance admits calls against that allowance, using the budget
definitions it last read, and keeps a journal of what it admitted. When the ledger answers again
the journal is booked into it (lua/book.lua), so nothing is lost.

The price: every instance has its own allowance, so during an outage spend can exceed the
ceiling by up to allowance x instances. The journal lives in the instance's memory; an instance
that dies during the outage loses its journal, and the provider's bill is then the only record
of what it admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from core.budgets import BudgetId
from core.errors import CeilingError, LedgerUnavailable
from core.ledger import (
    LedgerStore,
    LegStatus,
    Release,
    Reservation,
    ReservationRef,
    ReservationState,
    ReserveRequest,
    Settlement,
    resolved_replay,
)

# Budget paths whose allowances an instance remembers; bounded because paths come from keys.
KNOWN_PATHS_MAX = 50_000
# Journal entries one instance keeps; past this it fails closed even within its allowance,
# because an unbounded journal is unbounded memory.
JOURNAL_ENTRIES_MAX = 100_000


@dataclass
class JournalEntry:
    request: ReserveRequest
    admitted_at_ms: int
    actual_micros: int | None = None
    released: bool = False


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


class OutageAllowance:
    def __init__(self, clock: Callable[[], int] = _wall_clock_ms) -> None:
        self._clock = clock
        self._allowances: dict[tuple[str, ...], dict[str, int]] = {}
        self._admitted: dict[str, int] = {}
        self._journal: dict[tuple[str, str], JournalEntry] = {}

    @property
    def journal_size(self) -> int:
        return len(self._journal)

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
        if known is not None and (known.released or known.actual_micros is not None):
            # A replay of a call this instance already resolved: what became of it, as the
            # ledger answers a replay of a resolved reservation.
            state = ReservationState.RELEASED if known.released else ReservationState.SETTLED
            raise resolved_replay(
                request.ref.reservation_id, state, state.value, request.amount_micros,
                known.actual_micros or 0,
            )
        if key not in self._journal:
            for budget_id in allowances:
                self._admitted[budget_id] = self._admitted.get(budget_id, 0) + amount
            self._journal[key] = JournalEntry(request, now_ms)
        entry = self._journal[key]
        legs = tuple(
            LegStatus(b, "outage", a, 0, self._admitted[b], 0, None, a)
            for b, a in allowances.items()
        )
        return Reservation(
            request.ref.reservation_id, amount, entry.admitted_at_ms + request.ttl_ms, now_ms,
            entry.admitted_at_ms != now_ms, legs,
        )

    def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement | None:
        """Settle a call admitted during the outage, locally; None if it was not."""
        entry = self._journal.get((ref.tag, ref.reservation_id))
        if entry is None or entry.request.ref.owner != ref.owner or entry.released:
            return None
        replayed = entry.actual_micros is not None
        if not replayed:
            entry.actual_micros = actual_micros
            delta = actual_micros - entry.request.amount_micros
            for budget_id in self._allowances.get(
                tuple(b.path for b in entry.request.budget_ids), {}
            ):
                self._admitted[budget_id] = self._admitted.get(budget_id, 0) + delta
        amount = entry.request.amount_micros
        charged = entry.actual_micros or 0
        return Settlement(charged, max(0, amount - charged), max(0, charged - amount), False,
                          replayed)

    def release(self, ref: ReservationRef) -> Release | None:
        entry = self._journal.get((ref.tag, ref.reservation_id))
        if entry is None or entry.request.ref.owner != ref.owner or entry.actual_micros is not None:
            return None
        replayed = entry.released
        if not replayed:
            entry.released = True
            for budget_id in self._allowances.get(
                tuple(b.path for b in entry.request.budget_ids), {}
            ):
                self._admitted[budget_id] -= entry.request.amount_micros
        return Release(entry.request.amount_micros, replayed)

    async def flush(self, store: LedgerStore) -> int:
        """Book every finished journal entry into the ledger; return how many were booked.

        An entry still open is booked at its reserved amount once its lease has run out, the
        same as the ledger's 'charge' expiry: the worker may have been billed.
        """
        booked = 0
        now_ms = self._clock()
        for key, entry in list(self._journal.items()):
            if entry.released:
                del self._journal[key]
                continue
            actual = entry.actual_micros
            if actual is None:
                if now_ms < entry.admitted_at_ms + entry.request.ttl_ms:
                    continue
                actual = entry.request.amount_micros
            try:
                await store.book(entry.request, actual, entry.admitted_at_ms)
            except CeilingError:
                return booked  # still unreachable, or refused: keep the entry, try again later
            del self._journal[key]
            booked += 1
        if not self._journal:
            self._admitted.clear()
        return booked
