"""A restore is all of an organisation or none of it, refuses a malformed export before it writes
anything, and run again over what a cut-short run left (with --force) ends where one whole run
ends: no reservation charged twice, no counter of two exports.

The attacks: an export whose checksum is right and whose body is not what an export writes, at
every place of it; and a restore whose connection dies after n commands, for every n, then run
again. Judged by what the ledger holds afterwards, every key of it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import pytest

from core.budgets import BudgetId, Limit, Period, PerUser, Rate
from core.errors import InvalidRequest, LedgerUnavailable
from core.ledger import Role
from core.operations import Operations, checksum
from core.prices import PriceTable
from core.service import CeilingService
from core.stores import keys
from core.stores.memory import MemoryStore
from core.stores.operations import ScriptedCatalogue
from tests.core.stores.test_put_budget_atomic import DiesAfter
from tests.core.stores.test_users_admin import spend
from tests.core.stores.test_users_rates import held, put
from tests.support import ManualClock

BY = "admin:test"
TAGS = ("org:one", "org:two")


def _operations(store: MemoryStore) -> Operations:
    return Operations(CeilingService(store, PriceTable.from_file(None)), ScriptedCatalogue(store))


async def _exported() -> dict[str, Any]:
    """Two organisations with definitions, counters of several windows, end users, an open
    reservation each, and a key: everything an export carries."""
    store = MemoryStore(clock=ManualClock())
    per_user = PerUser((Limit(Period.DAY, 400), Limit(Period.TOTAL, 500)), users_max=3,
                       rate=Rate(requests_per_minute=100, concurrent_max=5))
    for tag in TAGS:
        await put(store, tag, (Period.DAY, 10**6), (Period.TOTAL, 10**7), per_user=per_user)
        await put(store, f"{tag}/team:a", (Period.MONTH, 10**6))
        await spend(store, tag, f"{tag}/team:a", 120, "alice")
        await spend(store, tag, tag, 30, "bob")
        await store.reserve(held(tag, f"{tag}/team:a", 70, "carol"))
    ops = _operations(store)
    await ops.create_key(BudgetId(f"{TAGS[0]}/team:a"), None, frozenset({Role.GATEWAY}), BY)
    return await ops.export(BY)


async def _held(store: MemoryStore) -> dict[str, Any]:
    """Every key the ledger holds and its value, but the ledger ids (a restore makes a new one),
    the audit stream and the library registry (which say when, not what)."""
    t = store.transport
    out: dict[str, Any] = {}
    for name in sorted(await t.execute("KEYS", "*")):
        if name in (keys.AUDIT_KEY, keys.LIBRARIES_KEY, keys.LEDGER_ID_KEY, keys.RESTORED_KEY):
            continue
        kind = await t.execute("TYPE", name)
        if kind == "hash":
            fields = await t.execute("HGETALL", name)
            value: Any = sorted(fields) if name == keys.ORGS_KEY else {
                k: v for k, v in fields.items() if k != "ledger"}
        elif kind == "zset":
            value = await t.execute("ZRANGE", name, "0", "-1", "WITHSCORES")
        elif kind == "string":
            value = await t.execute("GET", name)
        else:
            value = kind
        out[name] = value
    return out


def _counters(held_: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in held_.items() if f":{keys.COUNTER}" in k or f":{keys.RECORD}" in k
            or f":{keys.DEFINITION}" in k or f":{keys.USERS}" in k}


Mutation = Callable[[dict[str, Any]], None]


def _org(i: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda body: body["organisations"][i]


MALFORMED: dict[str, Mutation] = {
    "organisations not a list": lambda b: b.update(organisations={}),
    "an organisation's tag not a top scope": lambda b: _org(1)(b).update(tag="org:two/team:x"),
    "a budget of another organisation": lambda b: _org(1)(b)["budgets"][0].update(
        budget_id="org:one/team:z"),
    "a definition's field not a string": lambda b: _org(1)(b)["budgets"][0]["fields"].update(
        timezone=1),
    "a counter's committed not an integer": lambda b: _org(1)(b)["counters"][-1]["fields"]
    .update(committed="12x"),
    "a counter's window with a separator": lambda b: _org(1)(b)["counters"][-1].update(
        window_key="day|x"),
    "a counter's ttl": lambda b: _org(1)(b)["counters"][-1].update(ttl_ms=-5),
    "a reservation's record cut short": lambda b: _org(1)(b)["open_reservations"][0].update(
        record="open\tx"),
    "a reservation's id": lambda b: _org(1)(b)["open_reservations"][0].update(
        reservation_id="a b"),
    "end users of another organisation": lambda b: _org(1)(b)["users"][0].update(
        budget_id="org:one"),
    "an end user's id": lambda b: _org(1)(b)["users"][0]["users"].append("has/slash"),
    "a key's hash": lambda b: b["keys"][-1].update(key_hash="not a hash"),
    "keys not a list": lambda b: b.update(keys="none"),
}


@pytest.mark.parametrize("why", sorted(MALFORMED))
async def test_a_malformed_export_changes_nothing_and_is_refused_as_an_export(why: str) -> None:
    document = await _exported()
    tampered = json.loads(json.dumps(document))
    MALFORMED[why](tampered["body"])
    tampered["checksum"] = checksum(tampered)
    for force in (False, True):
        store = MemoryStore(clock=ManualClock())
        await store.open()
        if force:  # a ledger with data, as a forced restore finds one
            await put(store, "org:two", (Period.DAY, 5))
        before = await _held(store)
        with pytest.raises(InvalidRequest) as refused:
            await _operations(store).restore(tampered, None, force, BY)
        assert refused.value.details.get("field") == "export", why
        assert await _held(store) == before, why


async def _restored_whole(document: dict[str, Any]) -> dict[str, Any]:
    store = MemoryStore(clock=ManualClock())
    await store.open()
    await _operations(store).restore(document, None, False, BY)
    return _counters(await _held(store))


async def test_a_restore_cut_at_any_command_then_run_again_ends_as_one_whole_run() -> None:
    document = await _exported()
    whole = await _restored_whole(document)
    assert any(f":{keys.RECORD}" in k for k in whole)  # the open reservations, charged
    counting = MemoryStore(clock=ManualClock())
    await counting.open()
    wire = DiesAfter(counting.transport, 10**6)
    counting._t = wire
    await _operations(counting).restore(document, None, False, BY)
    for allowed in range(wire.sent):
        store = MemoryStore(clock=ManualClock())
        await store.open()
        working = store.transport
        store._t = DiesAfter(working, allowed)
        with contextlib.suppress(LedgerUnavailable):
            await _operations(store).restore(document, None, False, BY)
        store._t = working
        await _operations(store).restore(document, None, True, BY)
        assert _counters(await _held(store)) == whole, f"cut after {allowed} of {wire.sent}"


async def test_a_forced_restore_run_twice_is_one_restore() -> None:
    document = await _exported()
    store = MemoryStore(clock=ManualClock())
    await store.open()
    ops = _operations(store)
    first = await ops.restore(document, None, False, BY)
    once = _counters(await _held(store))
    again = await ops.restore(document, None, True, BY)
    assert _counters(await _held(store)) == once
    assert first["open_reservations_charged_as_unknown"] == len(TAGS)
    assert again["open_reservations_charged_as_unknown"] == 0


async def test_a_forced_restore_takes_the_organisations_the_export_lacks_under_its_new_id() -> None:
    """An organisation the ledger has and the export does not is stamped with the restored id
    too (lua/restore_tag.lua's 'restamp'): it serves on, its spend as it was."""
    document = await _exported()
    store = MemoryStore(clock=ManualClock())
    third = await put(store, "org:three", (Period.TOTAL, 1_000))
    await spend(store, "org:three", "org:three", 10, None)
    done = await _operations(store).restore(document, None, True, BY)
    assert await store.open() == done["ledger_id"]
    reservation = await store.reserve(held("org:three", third.path, 5))
    assert (reservation.legs[0].committed_micros, reservation.legs[0].reserved_micros) == (10, 5)
