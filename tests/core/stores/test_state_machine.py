"""A Hypothesis state machine drives random ledger steps and checks the books after each one.

Checked after every step, on every store kind:
- for every counter, committed + reserved <= ceiling + overshoot (equivalently: where no settle
  overshot, committed + reserved <= ceiling);
- reserved is never negative;
- a reservation moves only forward (open -> settled | released | expired -> settled | released)
  and is never resolved twice;
- the books reconcile to the micro-dollar: each counter's reserved is the sum of the open
  reservations, and its committed the sum of what settles charged plus what expiry charged;
- so do each end user's (the key's budget holds each user to its own limits, users_max of them),
  and the budget's concurrency count is its open reservations, never more than concurrent_max;
  no minute admits more than requests_per_minute.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from core.budgets import BudgetDef, BudgetId, Limit, Period, PerUser, Rate
from core.errors import (
    BudgetRefused,
    ConcurrencyLimited,
    IdempotencyConflict,
    RateLimited,
    ReservationResolved,
    UsersExhausted,
)
from core.ledger import (
    ExpirePolicy,
    LedgerStore,
    ReservationRef,
    ReservationState,
    ReserveRequest,
)
from core.limits import RATE_WINDOW_MS
from core.stores import keys
from core.stores.scripted import ScriptedStore
from tests.support import STORE_FACTORIES, ManualClock

T = TypeVar("T")
TTL_MS = 30_000
OWNER = "key_sm"
# The key's budget: a week, end users (two of them at most, one more to be refused) and a rate
# that the steps reach.
USERS = (None, "u1", "u2", "u3")
USERS_MAX = 2
RATE = Rate(requests_per_minute=12, concurrent_max=3)
REFUSED = (BudgetRefused, UsersExhausted, RateLimited, ConcurrencyLimited)
FORWARD = {
    ReservationState.OPEN: {ReservationState.OPEN, ReservationState.SETTLED,
                            ReservationState.RELEASED, ReservationState.EXPIRED},
    ReservationState.EXPIRED: {ReservationState.EXPIRED, ReservationState.SETTLED,
                               ReservationState.RELEASED},
    ReservationState.SETTLED: {ReservationState.SETTLED},
    ReservationState.RELEASED: {ReservationState.RELEASED},
}


def machine_for(request: pytest.FixtureRequest, kind: str) -> type[RuleBasedStateMachine]:
    class LedgerMachine(RuleBasedStateMachine):
        reservations = Bundle("reservations")

        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.clock = ManualClock()
            self.store: LedgerStore = STORE_FACTORIES[kind](request, self.clock)
            self.tag = f"org:sm{uuid.uuid4().hex[:12]}"
            self.path = BudgetId(f"{self.tag}/team:t/key:k")
            self.states: dict[str, ReservationState] = {}
            self.amounts: dict[str, int] = {}
            self.users: dict[str, str | None] = {}
            self.admitted_ms: list[int] = []
            self.overshoot: dict[str, int] = {}
            self.run(self.store.open())
            self.run(self.store.put_budget(BudgetDef(
                BudgetId(self.tag), (Limit(Period.DAY, 700), Limit(Period.TOTAL, 1_000)))))
            self.run(self.store.put_budget(BudgetDef(
                BudgetId(f"{self.tag}/team:t"), (Limit(Period.MONTH, 900),))))
            self.run(self.store.put_budget(BudgetDef(
                self.path, (Limit(Period.WEEK, 950),), rate=RATE,
                per_user=PerUser((Limit(Period.DAY, 250), Limit(Period.TOTAL, 400)),
                                 users_max=USERS_MAX))))

        def run(self, coro: Coroutine[Any, Any, T]) -> T:
            return self.loop.run_until_complete(coro)

        def teardown(self) -> None:
            self.run(self.store.close())
            self.loop.close()

        def ref(self, rid: str) -> ReservationRef:
            return ReservationRef(self.tag, rid, OWNER)

        @rule(
            target=reservations,
            amount=st.integers(1, 400),
            policy=st.sampled_from(ExpirePolicy),
            user=st.sampled_from(USERS),
        )
        def reserve(self, amount: int, policy: ExpirePolicy, user: str | None) -> str:
            rid = uuid.uuid4().hex
            try:
                self.run(self.store.reserve(ReserveRequest(
                    self.ref(rid), self.path.lineage, amount, TTL_MS, "fp", "v", "m", policy,
                    user=user,
                )))
            except REFUSED:
                return rid  # never admitted: settle and release must not find it
            self.amounts[rid] = amount
            self.users[rid] = user
            self.admitted_ms.append(self.clock.now_ms)
            return rid

        @rule(rid=reservations, ratio=st.sampled_from([0, 0.5, 1, 1.5]))
        def settle(self, rid: str, ratio: float) -> None:
            if rid not in self.amounts:
                return
            actual = int(self.amounts[rid] * ratio)
            try:
                s = self.run(self.store.settle(self.ref(rid), actual))
            except (ReservationResolved, IdempotencyConflict):
                return
            if not s.replayed:
                self.overshoot[rid] = s.overshoot_micros

        @rule(rid=reservations)
        def release(self, rid: str) -> None:
            if rid not in self.amounts:
                return
            try:
                self.run(self.store.release(self.ref(rid)))
            except ReservationResolved:
                return
            self.overshoot.pop(rid, None)

        @rule(ms=st.integers(1, TTL_MS))
        def advance_clock(self, ms: int) -> None:
            self.clock.advance(ms)

        @rule()
        def expire(self) -> None:
            self.run(self.store.expire(self.tag, 1_000))

        @invariant()
        def books_reconcile(self) -> None:
            views = {
                rid: self.run(self.store.reservation(self.ref(rid))) for rid in self.amounts
            }
            # By end user, and None for the whole path: open, committed, overshoot.
            books: dict[str | None, list[int]] = {u: [0, 0, 0] for u in USERS}
            opened = 0  # open, and within their lease: what holds a concurrency slot
            for rid, view in views.items():
                assert view is not None
                assert view.state in FORWARD[self.states.get(rid, ReservationState.OPEN)]
                self.states[rid] = view.state
                moved = [0, 0, self.overshoot.get(rid, 0)]
                if view.state is ReservationState.OPEN:
                    moved[0] = view.reserved_micros
                    opened += view.expires_at_ms is not None and (
                        view.expires_at_ms > self.clock.now_ms)
                elif view.state is ReservationState.SETTLED:
                    assert view.charged_micros is not None
                    moved[1] = view.charged_micros
                elif view.state is ReservationState.EXPIRED and view.outcome == "unknown":
                    moved[1] = view.reserved_micros
                for who in {None, self.users[rid]}:
                    books[who] = [a + b for a, b in zip(books[who], moved, strict=True)]
            # A status read naming a user shows the path's legs and the user's: each user's
            # read checks both.
            for user in USERS[1:]:
                user_path = self.path.user(user).path
                for leg in self.run(self.store.status(self.path.lineage, None, user)):
                    who = user if leg.budget_id == user_path else None
                    open_micros, committed_micros, overshoot_micros = books[who]
                    assert leg.reserved_micros >= 0
                    assert leg.reserved_micros == open_micros
                    assert leg.committed_micros == committed_micros
                    assert leg.overshoot_micros == overshoot_micros
                    assert leg.committed_micros + leg.reserved_micros <= (
                        leg.ceiling_micros + leg.overshoot_micros
                    )
            # users_max counts the users a call was charged for and those with one open: no
            # more than USERS_MAX of them, and every such user is counted (a released call's
            # user gives its place back).
            prefix = keys.prefix(self.tag)
            charged = set(self.run(self.store._t.execute(  # type: ignore[attr-defined]
                "ZRANGE", prefix + keys.USERS + self.path.path, "0", "-1")))
            pending = set(self.run(self.store._t.execute(  # type: ignore[attr-defined]
                "ZRANGE", prefix + keys.PENDING_USERS + self.path.path, "0", "-1")))
            assert len(charged) + len(pending) <= USERS_MAX
            assert not charged & pending
            for rid, seen in views.items():
                who_called = self.users[rid]
                if who_called is not None and seen is not None and (
                        seen.state is ReservationState.OPEN or (seen.charged_micros or 0) > 0):
                    assert who_called in charged | pending, (who_called, seen)
            assert opened <= (RATE.concurrent_max or 0)
            assert isinstance(self.store, ScriptedStore)
            count = self.run(self.store.transport.execute(
                "ZCOUNT", keys.prefix(self.tag) + keys.CONCURRENCY + self.path.path,
                f"({self.clock.now_ms}", "+inf"))
            assert int(count) == opened
            for at_ms in self.admitted_ms:
                in_a_minute = [t for t in self.admitted_ms if at_ms <= t < at_ms + RATE_WINDOW_MS]
                assert len(in_a_minute) <= (RATE.requests_per_minute or 0)

    return LedgerMachine


# Programs per store. The one implementation of the rules (the Lua every store runs) gets the
# full count on Redis; stores that only carry the same Lua over another transport (the memory
# store's in-process Redis, script-per-call, Cluster, Upstash's REST) get enough to exercise
# that transport's replies on every step kind, not the rules again.
PROGRAMS_RULES = 40
PROGRAMS_TRANSPORT = 10
PROGRAMS = {"memory": PROGRAMS_TRANSPORT, "redis": PROGRAMS_RULES}


@pytest.mark.slow
def test_ledger_state_machine(request: pytest.FixtureRequest, store_kind: str) -> None:
    run_state_machine_as_test(
        machine_for(request, store_kind),
        settings=settings(max_examples=PROGRAMS.get(store_kind, PROGRAMS_TRANSPORT),
                          stateful_step_count=30, deadline=None),
    )
