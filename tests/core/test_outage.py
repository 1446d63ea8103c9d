"""The outage journal books through the lifecycle's table, as the ledger would have."""

from __future__ import annotations

import dataclasses

import pytest

from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, Period
from core.errors import LedgerUnavailable, ReservationResolved
from core.ledger import LegStatus, ReservationRef, ReserveRequest
from core.outage import MODEL_RULES_PATHS_MAX, MODEL_RULES_READ_MS, OutageAllowance
from core.stores.memory import MemoryStore
from tests.support import ManualClock

TAG = "org:outage"
OWNER = "key_o"
TTL_MS = 60_000
DOWN = LedgerUnavailable("down", reason="ledger_unreachable")


def journal(clock: ManualClock, allowance_micros: int = 1_000) -> OutageAllowance:
    outage = OutageAllowance(clock)
    outage.learn((BudgetId(TAG),), (
        LegStatus(TAG, "total", 10_000, 0, 0, 0, None, allowance_micros),))
    return outage


def call(rid: str, amount_micros: int = 100) -> ReserveRequest:
    return ReserveRequest(ReservationRef(TAG, rid, OWNER), (BudgetId(TAG),), amount_micros,
                          TTL_MS, "fp", "v", "m")


def admitted(outage: OutageAllowance) -> int:
    return outage.admit(call("probe", 1), DOWN).legs[0].reserved_micros - 1


async def test_settles_and_releases_move_the_allowance_as_the_ledger_would() -> None:
    clock = ManualClock()
    outage = journal(clock)
    outage.admit(call("a"), DOWN)
    outage.admit(call("b"), DOWN)
    settled = outage.settle(call("a").ref, 130)
    assert settled is not None
    assert (settled.charged_micros, settled.released_micros, settled.overshoot_micros,
            settled.replayed) == (130, 0, 30, False)
    released = outage.release(call("b").ref)
    assert released is not None
    assert (released.released_micros, released.replayed) == (100, False)
    assert admitted(outage) == 130  # a's actual; b gave its hold back
    again = outage.settle(call("a").ref, 130)
    assert again is not None
    assert again.replayed
    assert outage.release(call("a").ref) is None  # settled: the ledger answers for it
    with pytest.raises(ReservationResolved):
        outage.admit(call("a"), DOWN)


async def test_a_refusal_is_the_outage_itself() -> None:
    outage = journal(ManualClock(), allowance_micros=150)
    outage.admit(call("a"), DOWN)
    with pytest.raises(LedgerUnavailable):
        outage.admit(call("b"), DOWN)


async def test_the_flush_books_actuals_and_expired_holds_and_drops_releases() -> None:
    clock = ManualClock()
    outage = journal(clock)
    for rid in ("settled", "released", "open"):
        outage.admit(call(rid), DOWN)
    outage.settle(call("settled").ref, 70)
    outage.release(call("released").ref)
    store = MemoryStore(clock=clock)
    await store.put_budget(BudgetDef(BudgetId(TAG), (Limit(Period.TOTAL, 10_000),)))
    assert await outage.flush(store) == 1  # the open call's lease has not run out
    clock.advance(TTL_MS)
    assert await outage.flush(store) == 1
    assert outage.journal_size == 0
    (total,) = await store.status((BudgetId(TAG),))
    # What was settled at its actual, and the call left open at its hold: the 'charge' expiry.
    assert (total.committed_micros, total.overshoot_micros, total.reserved_micros) == (
        170, 170, 0)


async def test_an_open_budget_admits_without_limit_and_journals_all_of_it() -> None:
    """outage_policy `open` (issue 17): past any allowance, every call admitted is journaled and
    booked into the ledger when it answers; health names the budget."""
    from core.budgets import OUTAGE_OPEN_ALLOWANCE_MICROS, OutagePolicy

    clock = ManualClock()
    store = MemoryStore(clock=clock)
    definition = BudgetDef(BudgetId(TAG), (Limit(Period.TOTAL, 10_000),),
                           outage_policy=OutagePolicy.OPEN)
    assert definition.ledger_allowance_micros == OUTAGE_OPEN_ALLOWANCE_MICROS
    await store.put_budget(definition)
    outage = OutageAllowance(clock)
    outage.learn((BudgetId(TAG),), await store.status((BudgetId(TAG),)))
    assert outage.open_budgets(10) == [TAG]
    amount = 10**12  # far past the budget's ceiling and any allowance
    for i in range(3):
        outage.admit(call(f"open{i}", amount), DOWN)
        assert outage.settle(ReservationRef(TAG, f"open{i}", OWNER), amount) is not None
    assert await outage.flush(store) == 3
    assert (await store.status((BudgetId(TAG),)))[0].committed_micros == 3 * amount
    closed = journal(clock, allowance_micros=0)
    with pytest.raises(LedgerUnavailable):
        closed.admit(call("closed"), DOWN)
    assert closed.open_budgets(10) == []


def test_a_policy_and_an_allowance_that_contradict_are_refused() -> None:
    from core.budgets import OutagePolicy
    from core.errors import InvalidRequest

    limits = (Limit(Period.TOTAL, 10),)
    for policy, allowance in ((OutagePolicy.CLOSED, 5), (OutagePolicy.ALLOWANCE, 0),
                              (OutagePolicy.OPEN, 5)):
        with pytest.raises(InvalidRequest):
            BudgetDef(BudgetId(TAG), limits, "UTC", allowance, policy)
    assert BudgetDef(BudgetId(TAG), limits, "UTC", 5).policy is OutagePolicy.ALLOWANCE
    assert BudgetDef(BudgetId(TAG), limits).policy is OutagePolicy.CLOSED


def test_an_outage_admits_only_the_models_the_ledger_would() -> None:
    """Allowed by every list on the path and limited by no per_model: admitted; any other model
    refused as the outage itself; an amount admitted by budget; a path whose rules were never
    read admits no model's call. The rules are read again after MODEL_RULES_READ_MS and the
    paths remembered are bounded."""
    clock = ManualClock()
    outage = journal(clock)
    path = (BudgetId(TAG),)
    assert outage.model_rules_due(path)
    model_call = dataclasses.replace(call("m1"), canonical_model="gpt-4o-mini")
    with pytest.raises(LedgerUnavailable):
        outage.admit(model_call, DOWN)  # never read: no model's call
    outage.admit(call("amount"), DOWN)  # an amount names no model
    definition = BudgetDef(BudgetId(TAG), (Limit(Period.TOTAL, 10_000),),
                           models_allow=("gpt-4o", "gpt-4o-mini"),
                           per_model=(ModelLimits("gpt-4o", (Limit(Period.DAY, 10),)),))
    outage.learn_model_rules(path, [definition])
    assert not outage.model_rules_due(path)
    outage.admit(model_call, DOWN)
    for model in ("gpt-4o", "gpt-4.1", "?"):
        with pytest.raises(LedgerUnavailable):
            outage.admit(dataclasses.replace(call(f"r-{model}"), canonical_model=model), DOWN)
    clock.advance(MODEL_RULES_READ_MS)
    assert outage.model_rules_due(path)
    for i in range(MODEL_RULES_PATHS_MAX + 1):
        outage.learn_model_rules((BudgetId(f"org:o{i}"),), [None])
    assert len(outage._model_rules) <= MODEL_RULES_PATHS_MAX
