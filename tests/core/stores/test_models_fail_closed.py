"""A budget with models, read by a version of spend-ceiling before per-model budgets: that
version reads a reserve's `rate` past the models flag (enforcing neither the allow-list nor the
per-model limits) but checks the definition's ledger id first, which a budget with models
follows with wire.MODELS_LEDGER_SUFFIX, so its calls are refused (`ledger_reset`) rather than
let through; this version reads both. Judged by the older version's own rule, run on what this
version stored: a put, and a restore of an export."""

from __future__ import annotations

import pytest

from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, Period
from core.errors import ModelNotAllowed
from core.ledger import LedgerStore
from core.stores import keys
from core.stores.memory import MemoryStore
from core.stores.scripted import ScriptedStore
from tests.core.stores.test_per_model import GPT5, HAIKU, call
from tests.core.stores.test_restore_atomic import BY, _operations
from tests.support import ManualClock

# The check the reserve of the version before per-model budgets (9b8c67d, lua/lib.lua
# resolve_legs) made of a definition's `ledger` field: the ledger's id, exactly.
OLDER_VERSION_ENFORCES = "return redis.call('HGET', KEYS[1], 'ledger') == ARGV[1] and 1 or 0"


async def older_version_enforces(store: ScriptedStore, bid: BudgetId) -> bool:
    ledger_id = await store.transport.execute("GET", keys.LEDGER_ID_KEY)
    found = await store.transport.execute("EVAL", OLDER_VERSION_ENFORCES, "1",
                                          keys.definition(bid.tag, bid.path), str(ledger_id))
    return int(found) == 1


async def put(store: LedgerStore, path: str, **models: object) -> BudgetId:
    bid = BudgetId.parse(path)
    await store.put_budget(BudgetDef(bid, (Limit(Period.DAY, 10**6),), **models))  # type: ignore
    return bid


@pytest.mark.parametrize("models", [
    {"models_allow": (HAIKU,)},
    {"per_model": (ModelLimits(GPT5, (Limit(Period.DAY, 100),)),)},
], ids=["allow", "per_model"])
async def test_an_older_version_refuses_a_budget_with_models_and_this_one_enforces_it(
        store: LedgerStore, tag: str, models: dict[str, object]) -> None:
    if not isinstance(store, ScriptedStore):
        pytest.skip("reads the definition hash")
    plain = await put(store, f"{tag}/team:plain")
    assert await older_version_enforces(store, plain)
    bid = await put(store, f"{tag}/team:models", **models)
    assert not await older_version_enforces(store, bid)
    if "models_allow" in models:
        with pytest.raises(ModelNotAllowed):
            await store.reserve(call(tag, bid.path, 1, GPT5))
    held = await store.reserve(call(tag, bid.path, 1, HAIKU if "models_allow" in models
                                    else GPT5))
    assert held.reserved_micros == 1
    # Put again without models: the suffix goes with them.
    await put(store, bid.path)
    assert await older_version_enforces(store, bid)


async def test_a_restored_budget_with_models_is_refused_by_an_older_version_too() -> None:
    """A restore writes each definition's ledger id anew (lua/restore_tag.lua): a budget with
    models keeps its suffix, one without gets none."""
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    tag = "org:restored"
    models = await put(store, f"{tag}/team:models", models_allow=(HAIKU,))
    plain = await put(store, f"{tag}/team:plain")
    exported = await _operations(store).export(BY)
    restored = MemoryStore(clock=clock)
    await _operations(restored).restore(exported, None, False, BY)
    assert not await older_version_enforces(restored, models)
    assert await older_version_enforces(restored, plain)
    with pytest.raises(ModelNotAllowed):
        await restored.reserve(call(tag, models.path, 1, GPT5))
    held = await restored.reserve(call(tag, models.path, 1, HAIKU))
    assert held.reserved_micros == 1
