"""What a scrape reads of a budget's models (core/metrics.py), on the in-process ledger: each
model of its per_model limits beside the budget, as the ledger's status read has them, and the
budgets ranked by their own periods, never by a model's (whose total may hold more than the
budget's day)."""

from __future__ import annotations

import dataclasses

from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, Period
from core.ledger import ReservationRef
from core.metrics import BudgetPeriod, read_ledger
from core.stores.memory import MemoryStore
from core.stores.operations import ScriptedCatalogue
from tests.core.stores.test_conformance import OWNER, request
from tests.support import ManualClock

GPT = "gpt-4o"
DAY_MS = 86_400_000


async def spend(store: MemoryStore, path: str, micros: int, model: str = "") -> None:
    tag = BudgetId(path).tag
    r = await store.reserve(dataclasses.replace(request(tag, path, micros), model=model,
                                                canonical_model=model))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), micros)


async def test_models_are_read_beside_their_budget_and_never_rank_it() -> None:
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    modelled, plain = BudgetId("org:ma"), BudgetId("org:mb")
    await store.put_budget(BudgetDef(modelled, (Limit(Period.DAY, 10**6),), per_model=(
        ModelLimits(GPT, (Limit(Period.DAY, 10**5), Limit(Period.TOTAL, 10**5))),)))
    await store.put_budget(BudgetDef(plain, (Limit(Period.DAY, 10**6),)))
    await spend(store, modelled.path, 500, GPT)
    clock.advance(DAY_MS)  # a new day: the model's total keeps 500, the budget's day starts at 0
    await spend(store, modelled.path, 10, GPT)
    await spend(store, plain.path, 100)
    index = ScriptedCatalogue(store)

    [shown] = {b.budget_id for b in (await read_ledger(store, index, "i", 1)).budgets}
    assert shown == plain.path  # 100 today against the other's 10

    reading = await read_ledger(store, index, "i", 2)
    mine = [b for b in reading.budgets if b.budget_id == modelled.path]
    assert [(b.model, b.period, b.ceiling_micros, b.committed_micros) for b in mine] == [
        (None, "day", 10**6, 10), (GPT, "day", 10**5, 10), (GPT, "total", 10**5, 510)]
    assert all(isinstance(b, BudgetPeriod) and b.reserved_micros == 0 for b in mine)
    assert not any(b.model for b in reading.budgets if b.budget_id == plain.path)
