"""A restore is all of an organisation or none of it, refuses a malformed export before it writes
anything, and run again over what a cut-short run left (with --force) ends where one whole run
ends: no reservation charged twice, no counter of two exports.

The attacks: an export whose checksum is right and whose body is not what an export writes, at
every place of it; and a restore whose connection dies after n commands, for every n, then run
again. Judged by what the ledger holds afterwards, every key of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from core.budgets import BudgetDef, BudgetId, Limit, Period, PerUser, Rate
from core.errors import InvalidRequest, LedgerUnavailable
from core.ledger import LedgerStore, Role
from core.operations import Operations, checksum
from core.prices import PriceTable
from core.service import CeilingService
from core.stores import keys, wire
from core.stores.export_v1 import body_of_format_1
from core.stores.memory import MemoryStore
from core.stores.operations import ScriptedCatalogue
from core.stores.scripted_catalogue import definition_fields, definition_of
from tests.core.stores.test_put_budget_atomic import DiesAfter
from tests.core.stores.test_users_admin import spend
from tests.core.stores.test_users_rates import held, put
from tests.core.test_budget_json import DEFINITIONS
from tests.support import ManualClock

BY = "admin:test"
# An export of format /1, made by the code before /2 (main at 78fbd34) from a ledger with every
# kind of thing an export carries, and every key the ledger held after that code restored it.
FIXTURES = Path(__file__).parents[2] / "fixtures"
FORMAT_1 = FIXTURES / "ledger-export-1.json"
FORMAT_1_RESTORED = FIXTURES / "ledger-export-1-restored.json"
TAGS = ("org:one", "org:two")


def _operations(store: MemoryStore) -> Operations:
    return Operations(CeilingService(store, PriceTable.from_file(None)), ScriptedCatalogue(store))


async def fill(store: LedgerStore, ops: Operations) -> None:
    """Two organisations with definitions, counters of several windows, end users, an open
    reservation each, and a key: everything an export carries."""
    per_user = PerUser((Limit(Period.DAY, 400), Limit(Period.TOTAL, 500)), users_max=3,
                       rate=Rate(requests_per_minute=100, concurrent_max=5))
    for tag in TAGS:
        await put(store, tag, (Period.DAY, 10**6), (Period.TOTAL, 10**7), per_user=per_user)
        await put(store, f"{tag}/team:a", (Period.MONTH, 10**6))
        await spend(store, tag, f"{tag}/team:a", 120, "alice")
        await spend(store, tag, tag, 30, "bob")
        await store.reserve(held(tag, f"{tag}/team:a", 70, "carol"))
    await ops.create_key(BudgetId(f"{TAGS[0]}/team:a"), None, frozenset({Role.GATEWAY}), BY)


async def _exported() -> dict[str, Any]:
    store = MemoryStore(clock=ManualClock())
    ops = _operations(store)
    await fill(store, ops)
    return await ops.export(BY)


def assert_restored_as_exported(first: dict[str, Any], second: dict[str, Any]) -> None:
    """`second`, the export of a ledger `first` was restored into, holds what `first` held: the
    same budgets, users, keys and reservations, and each open hold of `first` committed now, in
    every counter it held money in, its reservation charged as unknown."""
    assert second["body"]["keys"] == first["body"]["keys"]
    assert second["body"]["audit"][:len(first["body"]["audit"])] == first["body"]["audit"]
    before, after = first["body"]["organisations"], second["body"]["organisations"]
    for org, again in zip(before, after, strict=True):
        assert (again["tag"], again["budgets"], again["users"]) == (
            org["tag"], org["budgets"], org["users"])
        assert [(r["reservation_id"], r["reserved_micros"]) for r in again["reservations"]] \
            == [(r["reservation_id"], r["reserved_micros"]) for r in org["reservations"]]
        assert {r["state"] for r in again["reservations"]} <= {"expired"}
        held_in = {(leg["budget_id"], leg["window"]): r["reserved_micros"]
                   for r in org["reservations"] if r["state"] == "open" for leg in r["legs"]}
        committed = {(c["budget_id"], c["window"]): c["committed_micros"]
                     for c in org["counters"]}
        assert {(c["budget_id"], c["window"]): c["committed_micros"]
                for c in again["counters"]} == {
            k: committed.get(k, 0) + held_in.get(k, 0) for k in {*committed, *held_in}}


async def assert_export_restore_export(
        opened: Callable[[], Awaitable[tuple[LedgerStore, Operations]]],
        wipe: Callable[[], Awaitable[None]]) -> None:
    """On a real ledger: fill it, export it, wipe it, restore, export, and again. The first
    restore's export is the fixed point (an export's open reservation comes back charged as
    unknown, as its expiry would have left it); `opened` makes an instance on the ledger as it
    is now."""
    await wipe()
    store, ops = await opened()
    await fill(store, ops)
    documents = [await ops.export(BY)]
    for _ in range(2):
        await wipe()
        _, ops = await opened()
        await ops.restore(documents[-1], None, False, BY)
        documents.append(await ops.export(BY))
    first, second, third = documents
    assert_restored_as_exported(first, second)
    assert_same_but_the_restores_audit(second, third)


def assert_same_but_the_restores_audit(first: dict[str, Any], then: dict[str, Any]) -> None:
    """`then`, the export of a ledger `first` was restored into, is `first`, its audit stream
    with one entry more: the restore's."""
    entries, more = first["body"]["audit"], then["body"]["audit"]
    assert more[:len(entries)] == entries
    assert [e["what"] for e in more[len(entries):]] == ["ledger.restore"]
    assert {**then["body"], "audit": entries} == first["body"]


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
    "an organisation given twice": lambda b: b["organisations"].append(_org(1)(b)),
    "a budget of another organisation": lambda b: _org(1)(b)["budgets"][0].update(
        budget_id="org:one/team:z"),
    "a definition's timezone not a string": lambda b: _org(1)(b)["budgets"][0].update(
        timezone=1),
    "a definition's limit unknown": lambda b: _org(1)(b)["budgets"][0]["limits"].append(
        {"period": "hour", "ceiling_micros": 5}),
    "a definition with a field it cannot have": lambda b: _org(1)(b)["budgets"][0].update(
        color="red"),
    "a counter's committed not an integer": lambda b: _org(1)(b)["counters"][-1].update(
        committed_micros="12"),
    "a counter's window with a separator": lambda b: _org(1)(b)["counters"][-1].update(
        window="day|x"),
    "a counter's alert mark": lambda b: _org(1)(b)["counters"][-1].update(
        thresholds_alerted_pct=[0]),
    "a reservation that is not open": lambda b: _org(1)(b)["reservations"][0].update(
        state="settled"),
    "a reservation's id": lambda b: _org(1)(b)["reservations"][0].update(
        reservation_id="a b"),
    "a reservation's owner with a separator": lambda b: _org(1)(b)["reservations"][0].update(
        owner="key\tx"),
    "a reservation's leg of another organisation": lambda b: _org(1)(b)["reservations"][0][
        "legs"][0].update(budget_id="org:one"),
    "a reservation without legs": lambda b: _org(1)(b)["reservations"][0].update(legs=[]),
    "end users of another organisation": lambda b: _org(1)(b)["users"][0].update(
        budget_id="org:one"),
    "an end user's id": lambda b: _org(1)(b)["users"][0]["users"].append("has/slash"),
    "a key's hash": lambda b: b["keys"][-1].update(key_hash="not a hash"),
    "a key's roles": lambda b: b["keys"][-1].update(roles=["root"]),
    "keys not a list": lambda b: b.update(keys="none"),
    "an audit entry's id": lambda b: b["audit"][0].update(id="x"),
    "an audit entry's time not its id's": lambda b: b["audit"][0].update(at_ms=1),
    "an audit entry's detail": lambda b: b["audit"][0].update(detail="{}"),
    "audit entries out of order": lambda b: b["audit"].append(
        {**b["audit"][0], "id": "1-0", "at_ms": 1}),
    "a body with a section it cannot have": lambda b: b.update(runs=[]),
}
# The same, on a body of format /1 (its own shape: hash fields, packed records).
MALFORMED_1: dict[str, Mutation] = {
    "a definition's field not a string": lambda b: _org(1)(b)["budgets"][0]["fields"].update(
        timezone=1),
    "a definition without its timezone": lambda b: _org(1)(b)["budgets"][0]["fields"].pop(
        "timezone"),
    "a counter's committed not an integer": lambda b: _org(1)(b)["counters"][-1]["fields"]
    .update(committed="12x"),
    "a reservation's record cut short": lambda b: _org(1)(b)["open_reservations"][0].update(
        record="open\tx"),
    "end users not a list": lambda b: _org(1)(b)["users"][0].update(users="alice"),
    "a key without its hash": lambda b: b["keys"][-1].pop("key_hash"),
}


async def _refused_and_unchanged(tampered: dict[str, Any], why: str) -> None:
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


@pytest.mark.parametrize("why", sorted(MALFORMED))
async def test_a_malformed_export_changes_nothing_and_is_refused_as_an_export(why: str) -> None:
    tampered = json.loads(json.dumps(await _exported()))
    MALFORMED[why](tampered["body"])
    await _refused_and_unchanged(tampered, why)


@pytest.mark.parametrize("why", sorted(MALFORMED_1))
async def test_a_malformed_export_of_format_1_changes_nothing_and_is_refused(why: str) -> None:
    tampered = json.loads(FORMAT_1.read_text())
    MALFORMED_1[why](tampered["body"])
    await _refused_and_unchanged(tampered, why)


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
    # The export's audit entries once, then each restore's own.
    audit = (await ops.audit_page(None)).items[::-1]
    assert [e["id"] for e in audit[:-2]] == [e["id"] for e in document["body"]["audit"]]
    assert [e["what"] for e in audit[-2:]] == ["ledger.restore"] * 2


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


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


async def test_an_export_of_format_1_restores_as_the_code_that_wrote_it_restored_it() -> None:
    """Operators' backups made before /2: the ledger a restore leaves is the one the code of
    their time left, key for key (but the ledger ids, and the format stamp: this version's)."""
    store = MemoryStore(clock=ManualClock())
    await store.open()
    await _operations(store).restore(json.loads(FORMAT_1.read_text()), None, False, BY)
    then = json.loads(FORMAT_1_RESTORED.read_text())
    assert then.pop(keys.LEDGER_FORMAT_KEY) == "1"
    now = _json(await _held(store))
    assert now.pop(keys.LEDGER_FORMAT_KEY) == str(wire.LEDGER_FORMAT_VERSION)
    assert now == then


def test_a_format_1_key_without_roles_or_with_run_reads_as_the_migration_reads_it() -> None:
    """A /1 key of the layout before records were by id: the roles and run ceiling
    `ceiling ledger migrate` gives such a key in a ledger."""
    body = json.loads(FORMAT_1.read_text())["body"]
    key = body["keys"][0]
    ceiling = key.pop("run_ceiling_micros") or "700"
    key.pop("roles")
    key["run"] = ceiling
    read = body_of_format_1(body)["keys"][0]
    assert (read["roles"], read["run_ceiling_micros"]) == (["gateway", "sidecar"], int(ceiling))
    assert "run" not in read


async def _round(document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore into an empty ledger, then export it: (the new export, what the ledger holds)."""
    store = MemoryStore(clock=ManualClock())
    await store.open()
    ops = _operations(store)
    await ops.restore(document, None, False, BY)
    return await ops.export(BY), _counters(await _held(store))


@pytest.mark.parametrize("source", ["format 2", "format 1"])
async def test_export_restore_export_gives_the_same_document(source: str) -> None:
    """Once restored, a ledger exports as the document it was restored from: the same budgets,
    counters, users, keys and reservations; and two restores of it leave the same ledger. (An
    export's open reservation comes back charged as unknown, as its expiry would have left it:
    so the first restore's export is the fixed point.)"""
    first = await _exported() if source == "format 2" else json.loads(FORMAT_1.read_text())
    second, held_second = await _round(first)
    third, held_third = await _round(second)
    assert second["format"] == third["format"] == "spend-ceiling/ledger-export/2"
    assert_same_but_the_restores_audit(second, third)
    assert held_third == held_second
    if source == "format 2":
        assert_restored_as_exported(first, second)
        assert {r["state"] for o in first["body"]["organisations"]
                for r in o["reservations"]} == {"open"}


async def test_an_export_names_no_part_of_the_ledger_layout() -> None:
    document = await _exported()
    text = json.dumps(document)
    for layout in ("sc:", "\\t", "|", "ceiling_micros:", "fields", "alerted:", "meta", "+2"):
        assert layout not in text, layout
    org = document["body"]["organisations"][0]
    assert set(org) == {"tag", "reserve_sequence", "budgets", "counters", "reservations",
                        "users"}
    assert set(org["budgets"][0]) == {"budget_id", "limits", "timezone", "outage_policy",
                                      "outage_allowance_micros", "alerts", "paused_at_ms",
                                      "rate", "per_user", "clamp", "models", "per_model"}


@pytest.mark.parametrize("definition", DEFINITIONS)
async def test_a_restore_writes_a_definition_as_a_put_writes_it(definition: BudgetDef) -> None:
    """definition_fields, what a restore writes, is what lua/put_budget.lua writes (a pause
    aside, which only a velocity alarm sets), and it reads back as the same definition."""
    unpaused = dataclasses.replace(definition, paused_at_ms=None)
    store = MemoryStore(clock=ManualClock())
    await store.put_budget(unpaused)
    bid = unpaused.budget_id
    written = await store.transport.execute("HGETALL", keys.definition(bid.tag, bid.path))
    assert {k: v for k, v in written.items() if k != "ledger"} == definition_fields(unpaused)
    assert await store.get_budget(bid) == unpaused
    assert definition_of(bid.path, definition_fields(definition)) == definition


# Values a mutation puts anywhere in a body: every JSON type, and the separators of the layout.
ODD_VALUES: tuple[Any, ...] = (None, 0, -1, 1.5, "", "x", "a\tb", [], {}, [{}], [1], {"a": 1},
                               True, 2**60, "org:one", [None])
MUTATIONS = 3_000


def _places(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    inner = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    return [at, *(p for k, v in inner for p in _places(v, (*at, k)))]


@pytest.mark.parametrize("source", ["format 2", "format 1"])
async def test_any_value_anywhere_in_a_body_is_read_or_refused_as_an_export(source: str) -> None:
    """Seeded random mutations of a whole body, checked as a restore checks it (no store): each
    is a body, or refused with field=export; never another error."""
    import random

    from core.stores.export_body import checked
    from core.stores.export_v1 import body_of_format_1

    body = (await _exported())["body"] if source == "format 2" else json.loads(
        FORMAT_1.read_text())["body"]
    def read(raw: object) -> object:
        return checked(raw if source == "format 2" else body_of_format_1(raw),
                       PriceTable().model_name)

    places = [p for p in _places(body) if p]
    chance = random.Random(36)
    for _ in range(MUTATIONS):
        tampered = json.loads(json.dumps(body))
        place = chance.choice(places)
        parent = tampered
        for k in place[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and chance.random() < 0.2:
            del parent[place[-1]]
        else:
            parent[place[-1]] = chance.choice(ODD_VALUES)
        refused: list[InvalidRequest] = []
        try:
            read(tampered)
        except InvalidRequest as exc:
            refused.append(exc)
        assert all(exc.details.get("field") == "export" for exc in refused), place
