"""A budget's models through an export and a restore: the definition (models.allow, per_model),
each model's counters ('<budget>/model:<model>', a model's name of ':' too, which no budget id
an operator names may hold) and an open reservation's model legs, each flagged a model's (quiet:
its spend raises no alert, its budget's does) come back as they were, and are enforced as before.
Judged by the ledger's own status reads and its records, before and after."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from typing import Any

import pytest

from core.budgets import ALL_MODELS, BudgetDef, BudgetId, Limit, ModelLimits, Period
from core.errors import BudgetRefused, InvalidRequest
from core.ledger import LedgerStore, ReservationRef, ReserveRequest
from core.operations import Operations, checksum
from core.prices import PriceTable, Rates
from core.service import CeilingService
from core.stores import keys, wire
from core.stores.memory import MemoryStore
from core.stores.operations import ScriptedCatalogue
from tests.core.stores.test_conformance import OWNER, request
from tests.core.stores.test_restore_atomic import (
    BY,
    assert_restored_as_exported,
    assert_same_but_the_restores_audit,
)
from tests.support import ManualClock

TAG = "org:models"
GPT = "gpt-4o"
# A model's one name may hold ':' (a Bedrock id's version), which a budget id's scope may not.
NOVA = "amazon.nova-pro-v1:0"
GPT_DAY_MICROS = 1_000
NOVA_TOTAL_MICROS = 900
DEFINITION = BudgetDef(
    BudgetId(f"{TAG}/team:a"), (Limit(Period.DAY, 10**6),),
    models_allow=(NOVA, GPT),  # in order, as a put (and a restore) gives them
    per_model=(ModelLimits(NOVA, (Limit(Period.TOTAL, NOVA_TOTAL_MICROS),)),
               ModelLimits(GPT, (Limit(Period.DAY, GPT_DAY_MICROS),
                                 Limit(Period.TOTAL, 5 * GPT_DAY_MICROS)))))


# NOVA's price is the 'aws' table's alone, which a budget's names are not looked up in: the
# prices file names it, so that a budget (and a restore) can.
PRICES = PriceTable({NOVA: Rates(((0, Decimal(1)),), ((0, Decimal(1)),))})


def _operations(store: MemoryStore) -> Operations:
    return Operations(CeilingService(store, PRICES), ScriptedCatalogue(store))


def call(micros: int, model: str) -> ReserveRequest:
    return dataclasses.replace(request(TAG, DEFINITION.budget_id.path, micros),
                               model=model, canonical_model=model)


async def fill(store: LedgerStore) -> str:
    """Spend on both models, and a call of GPT left open; its reservation id."""
    await store.put_budget(DEFINITION)
    for micros, model in ((300, GPT), (200, NOVA)):
        r = await store.reserve(call(micros, model))
        await store.settle(ReservationRef(TAG, r.reservation_id, OWNER), micros)
    return (await store.reserve(call(50, GPT))).reservation_id


async def readings(store: LedgerStore) -> dict[str, tuple[int, int]]:
    legs = await store.status((DEFINITION.budget_id,), model=ALL_MODELS)
    return {f"{leg.budget_id}|{leg.window_key}": (leg.committed_micros, leg.reserved_micros)
            for leg in legs}


async def record_legs(store: MemoryStore, reservation_id: str) -> str:
    packed = await store.transport.execute("GET", keys.reservation(TAG, reservation_id))
    return wire.StoredRecord.unpacked(packed).legs


async def test_a_budgets_models_and_their_counters_come_back_as_they_were() -> None:
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    ops: Operations = _operations(store)
    open_id = await fill(store)
    before = await readings(store)
    gpt, nova = DEFINITION.budget_id.model(GPT).path, DEFINITION.budget_id.model(NOVA).path
    assert {k.split("|")[0] for k in before} == {DEFINITION.budget_id.path, gpt, nova}
    legs_before = await record_legs(store, open_id)
    assert f"{gpt}|" in legs_before
    exported = await ops.export(BY)
    [org] = exported["body"]["organisations"]
    [budget] = org["budgets"]
    assert (budget["models"], budget["per_model"]) == (
        {"allow": [NOVA, GPT]},
        {GPT: {"limits": [{"period": "day", "ceiling_micros": GPT_DAY_MICROS},
                          {"period": "total", "ceiling_micros": 5 * GPT_DAY_MICROS}]},
         NOVA: {"limits": [{"period": "total", "ceiling_micros": NOVA_TOTAL_MICROS}]}})
    counted = {c["budget_id"]: c["committed_micros"] for c in org["counters"]
               if c["window"] == "total"}
    assert (counted[gpt], counted[nova]) == (300, 200)

    second_store = MemoryStore(clock=clock)
    ops = _operations(second_store)
    await ops.restore(exported, None, False, BY)
    second = await ops.export(BY)
    third_store = MemoryStore(clock=clock)
    ops = _operations(third_store)
    await ops.restore(second, None, False, BY)
    third = await ops.export(BY)
    assert_restored_as_exported(exported, second)
    assert_same_but_the_restores_audit(second, third)
    store = second_store
    # The open hold of 50 comes back charged as unknown, in the model's counters too.
    assert await readings(store) == {k: (c + r, 0) for k, (c, r) in before.items()}
    # Its record keeps its model legs as the reserve wrote them (flags and all).
    assert await record_legs(store, open_id) == legs_before
    # Enforced as before: GPT's day holds 1,000 and 350 of it is spent.
    with pytest.raises(BudgetRefused) as refused:
        await store.reserve(call(GPT_DAY_MICROS - 350 + 1, GPT))
    assert refused.value.details["budget_id"] == gpt
    await store.reserve(call(GPT_DAY_MICROS - 350, GPT))
    with pytest.raises(BudgetRefused) as refused:
        await store.reserve(call(NOVA_TOTAL_MICROS - 200 + 1, NOVA))
    assert refused.value.details["budget_id"] == nova


def _tampered(document: dict[str, Any], budget_id: str) -> dict[str, Any]:
    out = json.loads(json.dumps(document))
    out["body"]["organisations"][0]["counters"][0]["budget_id"] = budget_id
    out["checksum"] = checksum(out)
    return out


@pytest.mark.parametrize("budget_id", [
    f"{TAG}/team:a/model:has space", f"{TAG}/team:a/model:UPPER", f"{TAG}/team:a/model:",
    f"org:other/model:{GPT}"])
async def test_a_model_counter_that_is_not_one_is_refused_whole(budget_id: str) -> None:
    store = MemoryStore(clock=ManualClock())
    ops = _operations(store)
    await fill(store)
    document = _tampered(await ops.export(BY), budget_id)
    with pytest.raises(InvalidRequest):
        await ops.restore(document, None, False, BY)


def _renamed(document: dict[str, Any], per_model: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(document))
    out["body"]["organisations"][0]["budgets"][0]["per_model"] = per_model
    out["checksum"] = checksum(out)
    return out


async def test_a_restored_budget_names_each_model_by_its_one_name() -> None:
    """An export that names a model otherwise (a dated snapshot) restores it by its one name,
    whose counter the ledger holds; one naming a model no table knows, or one model twice, is
    refused as an export, nothing written."""
    store = MemoryStore(clock=ManualClock())
    ops = _operations(store)
    await fill(store)
    exported = await ops.export(BY)
    limits = {"limits": [{"period": "day", "ceiling_micros": GPT_DAY_MICROS}]}
    second = MemoryStore(clock=ManualClock())
    await _operations(second).restore(
        _renamed(exported, {"GPT-4o-2024-08-06": limits}), None, False, BY)
    restored = await second.get_budget(DEFINITION.budget_id)
    assert restored is not None
    assert [m.model for m in restored.per_model] == [GPT]
    for per_model in ({"nope-model-x": limits}, {GPT: limits, "gpt-4o-2024-08-06": limits}):
        third = MemoryStore(clock=ManualClock())
        with pytest.raises(InvalidRequest) as refused:
            await _operations(third).restore(_renamed(exported, per_model), None, False, BY)
        assert refused.value.details.get("field") == "export", refused.value
        assert await third.get_budget(DEFINITION.budget_id) is None
