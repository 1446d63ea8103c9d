"""A reservation's lifecycle: one transition table, the only statement of what each step books.

A reservation holds money in the counters of its legs (one budget in one period window each):
while open its hold sits in `reserved`; once it counts as spent, the amount sits in `committed`.
Every step moves it from one state to the next and books the difference, so the table says two
things and the effects follow from them by one rule (`effects` below):

- HOLDINGS: what a reservation of `held` micros has in its legs' counters in each state (under
  its expire policy, which matters only once it expired): its share of `reserved`, of
  `committed`, and what was held for it (`covered`, what a charge is measured against).
- TRANSITIONS: which event may move a reservation from which state, to which state, with which
  outcome. An event with no row for a state is refused (or, for a repeat, answered as before).

    reserved  += reserved(to) - reserved(from)
    committed += committed(to) - committed(from)
    overshoot += max(0, committed(to) - covered(from))    what was charged beyond what was held
    released   = max(0, covered(from) - committed(to))    what the step gave back

The outage journal books through `effects`; the lua/ scripts, which every store runs, get both
tables in the prelude core/stores/wire.py generates and book by the same rule (lua/lib.lua
`effects`); the table-driven conformance test (tests/core/stores/test_conformance.py) runs every
row against every store; lua/README.md shows the table.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from core.errors import InvariantBroken
from core.ledger import ExpirePolicy, ReservationState


class Event(StrEnum):
    """What happens to a reservation (the ledger's verbs; `correct` is an operator's settle,
    `book` writes spend an instance admitted during a ledger outage)."""

    RESERVE = "reserve"
    SETTLE = "settle"
    RELEASE = "release"
    EXPIRE = "expire"
    CORRECT = "correct"
    BOOK = "book"


# The state of a reservation id nothing was recorded under: where reserve and book start.
ABSENT = "absent"
# A ReservationState, or ABSENT (a StrEnum is its value, so both key the tables alike).
State = str


class Share(StrEnum):
    """An amount in terms of the reservation: nothing, its hold, or the actual it settled at."""

    NOTHING = "nothing"
    HELD = "held"
    ACTUAL = "actual"


class Holding(NamedTuple):
    reserved: Share
    committed: Share
    covered: Share


class Outcome(StrEnum):
    """What is known of what became of a reservation (ReservationView.outcome)."""

    NONE = ""  # open: nothing yet
    SETTLED = "settled"
    RELEASED = "released"
    CORRECTED = "corrected"  # an operator settled it (Correction)
    JOURNAL = "journal"  # booked from an instance's outage journal
    UNKNOWN = "unknown"  # expired under 'charge': the worker may have been billed, so it is


class Step(NamedTuple):
    to: ReservationState
    outcome: Outcome


_CHARGE, _RELEASE = ExpirePolicy.CHARGE, ExpirePolicy.RELEASE
_OPEN, _SETTLED = ReservationState.OPEN, ReservationState.SETTLED
_RELEASED, _EXPIRED = ReservationState.RELEASED, ReservationState.EXPIRED
_N, _H, _A = Share.NOTHING, Share.HELD, Share.ACTUAL

HOLDINGS: dict[tuple[State, ExpirePolicy], Holding] = {
    (ABSENT, _CHARGE): Holding(_N, _N, _N),
    (ABSENT, _RELEASE): Holding(_N, _N, _N),
    (_OPEN, _CHARGE): Holding(_H, _N, _H),
    (_OPEN, _RELEASE): Holding(_H, _N, _H),
    # Expiry under 'charge' books the hold as spent; under 'release' it gives it back.
    (_EXPIRED, _CHARGE): Holding(_N, _H, _H),
    (_EXPIRED, _RELEASE): Holding(_N, _N, _N),
    (_SETTLED, _CHARGE): Holding(_N, _A, _N),
    (_SETTLED, _RELEASE): Holding(_N, _A, _N),
    (_RELEASED, _CHARGE): Holding(_N, _N, _N),
    (_RELEASED, _RELEASE): Holding(_N, _N, _N),
}

TRANSITIONS: dict[tuple[Event, State, ExpirePolicy], Step] = {
    (Event.RESERVE, ABSENT, _CHARGE): Step(_OPEN, Outcome.NONE),
    (Event.RESERVE, ABSENT, _RELEASE): Step(_OPEN, Outcome.NONE),
    (Event.EXPIRE, _OPEN, _CHARGE): Step(_EXPIRED, Outcome.UNKNOWN),
    (Event.EXPIRE, _OPEN, _RELEASE): Step(_EXPIRED, Outcome.RELEASED),
    (Event.SETTLE, _OPEN, _CHARGE): Step(_SETTLED, Outcome.SETTLED),
    (Event.SETTLE, _OPEN, _RELEASE): Step(_SETTLED, Outcome.SETTLED),
    # A late settle: the call outlived its lease and its actual replaces what expiry booked.
    (Event.SETTLE, _EXPIRED, _CHARGE): Step(_SETTLED, Outcome.SETTLED),
    (Event.SETTLE, _EXPIRED, _RELEASE): Step(_SETTLED, Outcome.SETTLED),
    (Event.RELEASE, _OPEN, _CHARGE): Step(_RELEASED, Outcome.RELEASED),
    (Event.RELEASE, _OPEN, _RELEASE): Step(_RELEASED, Outcome.RELEASED),
    (Event.RELEASE, _EXPIRED, _CHARGE): Step(_RELEASED, Outcome.RELEASED),
    (Event.RELEASE, _EXPIRED, _RELEASE): Step(_RELEASED, Outcome.RELEASED),
    # An operator corrects what nobody else may lower: an open hold, or an expiry's charge of
    # an unknown outcome. A lease expiry already gave back ('release') has nothing to correct.
    (Event.CORRECT, _OPEN, _CHARGE): Step(_SETTLED, Outcome.CORRECTED),
    (Event.CORRECT, _OPEN, _RELEASE): Step(_SETTLED, Outcome.CORRECTED),
    (Event.CORRECT, _EXPIRED, _CHARGE): Step(_SETTLED, Outcome.CORRECTED),
    # Spend admitted during an outage is already spent: nothing was held for it.
    (Event.BOOK, ABSENT, _CHARGE): Step(_SETTLED, Outcome.JOURNAL),
}


class Effects(NamedTuple):
    """One step of one reservation: what it books in each of its legs' counters, what it
    answers, and where it leaves the reservation."""

    to: ReservationState
    outcome: Outcome
    reserved_delta: int
    committed_delta: int
    overshoot_micros: int  # added to each leg's overshoot, and answered
    released_micros: int
    charged_micros: int  # what the reservation counts as spent once the step is done
    late: bool  # a step after the lease expired


def _amount(share: Share, held_micros: int, actual_micros: int) -> int:
    if share is Share.HELD:
        return held_micros
    return actual_micros if share is Share.ACTUAL else 0


def step(event: Event, state: State, policy: ExpirePolicy) -> Step | None:
    """The row for `event` from `state`, or None when the table has none (the event is
    refused)."""
    return TRANSITIONS.get((event, state, policy))


def effects(
    event: Event, state: State, policy: ExpirePolicy, held_micros: int, actual_micros: int = 0
) -> Effects:
    """What `event` books for a reservation of `held_micros` in `state`; `actual_micros` is what
    it settles at (settle, correct, book). Only for a row of the table: ask `step` first. No row
    leaves a settled reservation, so `actual` always means this step's."""
    row = step(event, state, policy)
    if row is None:  # checked on every step, its message built only on failure
        raise InvariantBroken(f"no transition {event} from {state} under {policy}")
    before, after = HOLDINGS[(state, policy)], HOLDINGS[(row.to, policy)]
    charged = _amount(after.committed, held_micros, actual_micros)
    covered = _amount(before.covered, held_micros, actual_micros)
    return Effects(
        row.to, row.outcome,
        _amount(after.reserved, held_micros, actual_micros)
        - _amount(before.reserved, held_micros, actual_micros),
        charged - _amount(before.committed, held_micros, actual_micros),
        max(0, charged - covered), max(0, covered - charged), charged,
        # Spend booked from a journal is late by nature: it was admitted before the ledger knew.
        state == ReservationState.EXPIRED or event is Event.BOOK,
    )


def charged_micros(state: State, policy: ExpirePolicy, held_micros: int,
                   settled_micros: int) -> int:
    """What a reservation in `state` counts as spent: its committed share."""
    return _amount(HOLDINGS[(state, policy)].committed, held_micros, settled_micros)
