"""A budget is put whole or not at all: its definition, its alert settings (the thresholds in the
definition, the velocity alarm in the tag's meta hash, which every settle reads) and its places in
the operators' catalogue.

The attack: the connection dies after the first n commands of a put, for every n up to the
commands a whole put takes, and the ledger is read back through a connection that works. What it
holds must be the budget as it was before the put, or as the put asked, never a mixture (new
limits beside the old alarm, a budget with no velocity alarm that asked for one, a budget that
is enforced but missing from the lists).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import pytest

from core.alerts import AlertConfig, VelocityAlarm
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import LedgerUnavailable
from core.stores import keys
from core.stores.memory import MemoryStore
from core.stores.operations import ScriptedCatalogue
from core.stores.scripted import Transport
from core.stores.scripts import Script

TAG = "org:atomic"
BID = BudgetId(f"{TAG}/team:a")
ALARM = VelocityAlarm(window_s=300, max_micros=5_000_000, pause=True)
# The budget before the put: a velocity alarm that pauses it, two thresholds.
BEFORE = BudgetDef(BID, (Limit(Period.DAY, 10_000_000),),
                   alerts=AlertConfig((50, 90), ALARM))
# What the put asks for: other limits, other thresholds, no velocity alarm.
AFTER = BudgetDef(BID, (Limit(Period.DAY, 4_000_000), Limit(Period.MONTH, 70_000_000)),
                  alerts=AlertConfig((80,), None))


class DiesAfter:
    """A transport whose connection dies after `allowed` commands: every one after fails as a
    lost connection does, whether or not the server ran it is not the caller's to know."""

    def __init__(self, inner: Transport, allowed: int) -> None:
        self.inner, self.allowed, self.sent = inner, allowed, 0
        self.backend = inner.backend

    def _spend(self) -> None:
        self.sent += 1
        if self.sent > self.allowed:
            raise LedgerUnavailable("connection lost (injected)", reason="ledger_unreachable")

    async def run(self, script: Script, keys_: Sequence[str], args: Sequence[str]) -> Any:
        self._spend()
        return await self.inner.run(script, keys_, args)

    async def execute(self, *args: str) -> Any:
        self._spend()
        return await self.inner.execute(*args)

    async def durability(self) -> Any:
        return await self.inner.durability()

    async def close(self) -> None:
        await self.inner.close()


async def _held(store: MemoryStore) -> tuple[Any, ...]:
    """What the ledger holds of the budget, read with a working connection."""
    definition = await store.get_budget(BID)
    alarms = await store.transport.execute("HGET", keys.meta(TAG), keys.VELOCITY_FIELD) or ""
    listed = BID.path in await ScriptedCatalogue(store).budget_ids(TAG, None, 100)
    org = await store.transport.execute("HGET", keys.ORGS_KEY, TAG)
    return definition, f" {BID.path}," in alarms, listed, org is not None


async def _put_cut(store: MemoryStore, definition: BudgetDef, allowed: int) -> int:
    """Put `definition` over a connection that dies after `allowed` commands; the commands the
    put sent (or tried to). The store's own connection is back in place afterwards."""
    working = store.transport
    cut = DiesAfter(working, allowed)
    store._t = cut  # the wire a put goes over, and nothing else, is swapped
    try:
        with contextlib.suppress(LedgerUnavailable):
            await store.put_budget(definition)
    finally:
        store._t = working
    return cut.sent


async def test_a_put_cut_at_any_command_leaves_the_old_budget_or_the_new_one() -> None:
    whole = MemoryStore()
    await whole.put_budget(BEFORE)
    total = await _put_cut(whole, AFTER, 10**6)
    assert await _held(whole) == (AFTER, False, True, True)
    for allowed in range(total):
        store = MemoryStore()
        await store.put_budget(BEFORE)
        await _put_cut(store, AFTER, allowed)
        held = await _held(store)
        assert held in ((BEFORE, True, True, True), (AFTER, False, True, True)), (
            f"cut after {allowed} of {total} commands: half a budget: {held}")


async def test_a_first_put_cut_at_any_command_leaves_no_budget_or_a_whole_one() -> None:
    whole = MemoryStore()
    await whole.open()
    total = await _put_cut(whole, BEFORE, 10**6)
    assert await _held(whole) == (BEFORE, True, True, True)
    for allowed in range(total):
        store = MemoryStore()
        await store.open()
        await _put_cut(store, BEFORE, allowed)
        held = await _held(store)
        # Not listed without a definition: a list reads each definition, and skips none here.
        assert held in ((None, False, False, False), (BEFORE, True, True, True)), (
            f"cut after {allowed} of {total} commands: half a budget: {held}")


@pytest.mark.parametrize("times", [1, 2])
async def test_a_put_run_again_is_the_same_budget(times: int) -> None:
    store = MemoryStore()
    for _ in range(times):
        await store.put_budget(BEFORE)
    assert await _held(store) == (BEFORE, True, True, True)


async def test_on_a_cluster_a_cut_put_leaves_the_budget_whole_and_a_put_again_lists_it() -> None:
    """On a Redis Cluster (the scripts' keys in one slot each) the catalogue is in another slot
    than the budget, so its two entries follow the script: a put cut between them leaves the
    budget whole and enforced, not yet listed, and the same put run again lists it."""
    whole = MemoryStore()
    await whole.open()
    whole._t = AsCluster(whole.transport)
    total = await _put_cut(whole, BEFORE, 10**6)
    assert await _held(whole) == (BEFORE, True, True, True)
    unlisted = 0
    for allowed in range(total):
        store = MemoryStore()
        await store.open()
        store._t = AsCluster(store.transport)
        await _put_cut(store, BEFORE, allowed)
        definition, alarmed, listed, org = await _held(store)
        assert (definition, alarmed) in ((None, False), (BEFORE, True)), (
            f"cut after {allowed} of {total} commands: half a budget: {definition}, {alarmed}")
        unlisted += definition is not None and not (listed and org)
        await store.put_budget(BEFORE)
        assert await _held(store) == (BEFORE, True, True, True)
    assert unlisted == 2  # cut after the script, and after the organisation's entry


class AsCluster(DiesAfter):
    """A transport that says it is a Redis Cluster's, so the store takes the cluster's path."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner, 10**6)
        self.backend = "redis-cluster"
