"""The operators' catalogue on a real Redis: lists, delete, rotation, audit, export and restore.

Judged by what the ledger holds afterwards (read back through the store's own scripts), never by
what an operation answered about itself.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from core.budgets import BudgetDef, BudgetId, Limit, OutagePolicy, Period
from core.errors import (
    BudgetInUse,
    BudgetNotFound,
    InvalidRequest,
    LedgerNotEmpty,
    LedgerUnavailable,
    Unauthorized,
)
from core.ledger import KeyRecord, ReservationRef, ReservationState, ReserveRequest, Role
from core.operations import BILL_FORMAT, PAGE_SIZE_MAX, Operations, checksum
from core.prices import PriceTable
from core.service import CeilingService, hash_api_key, key_id_of, new_key_id
from core.stores import keys
from core.stores.durability import Durability
from core.stores.migrate import migrate
from core.stores.operations import ScriptedCatalogue
from core.stores.redis import RedisStore, RedisTransport, redis_client
from core.stores.scripted import ScriptedStore
from core.stores.scripts import Script
from infra.redis_server import RedisServer
from tests.support import ManualClock

BY = "admin:test"
TTL_MS = 60_000


@pytest.fixture
def server() -> AsyncIterator[RedisServer]:
    """A Redis of its own: restores need an empty ledger."""
    with RedisServer(durable=False) as s:
        yield s


async def _service(url: str) -> CeilingService:
    store = RedisStore(url)
    await store.open()
    return CeilingService(store, PriceTable.from_file(None))


def _operations(svc: CeilingService) -> Operations:
    """The operations over `svc`'s Redis ledger, with the catalogue kept beside it."""
    return Operations(svc, ScriptedCatalogue(svc.store))


@asynccontextmanager
async def _instance(url: str) -> AsyncIterator[tuple[CeilingService, Operations]]:
    """An instance on the ledger at `url` and its operations, closed on the way out."""
    svc = await _service(url)
    try:
        yield svc, _operations(svc)
    finally:
        await svc.store.close()


def _request(bid: BudgetId, amount: int, rid: str | None = None) -> ReserveRequest:
    return ReserveRequest(
        ref=ReservationRef(bid.tag, rid or f"r{uuid.uuid4().hex}", "key_owner"),
        budget_ids=bid.lineage, amount_micros=amount, ttl_ms=TTL_MS, fingerprint="fp",
        price_version="test")


async def _taken(svc: CeilingService, *secrets: str) -> list[bool]:
    """Whether the ledger takes each secret now (its key's record, read with no trust cache)."""
    return [await svc.store.get_key(hash_api_key(s), key_id_of(s)) is not None for s in secrets]


async def _hash_only_key(raw: aioredis.Redis, bid: BudgetId, roles: str = "sidecar"
                         ) -> tuple[str, str]:
    """A key as versions before records were by id made one (an entry under the secret's
    hash, a pointer from the id), with a secret of theirs (no key id in it): (id, secret)."""
    key_id, secret = f"key_{uuid.uuid4().hex[:16]}", f"sk-ceil-{uuid.uuid4().hex}"
    await raw.set(keys.api_key_id(key_id), hash_api_key(secret))
    await raw.hset(keys.api_key(hash_api_key(secret)), mapping={
        "key_id": key_id, "budget_id": bid.path, "run_ceiling_micros": "", "roles": roles,
        "created_ms": "1"})
    return key_id, secret


async def _put(ops: Operations, path: str, total: int, **kw: object) -> BudgetId:
    bid = BudgetId.parse(path)
    await ops.put_budget(BudgetDef(bid, (Limit(Period.TOTAL, total),), **kw), BY)  # type: ignore[arg-type]
    return bid


async def test_lists_page_with_a_cursor_and_never_show_secrets(server: RedisServer) -> None:
    async with _instance(server.url) as (svc, ops):
        for i in range(5):
            await _put(ops, f"org:a/team:t{i}", 100)
        await _put(ops, "org:b", 100)
        seen, cursor = [], None
        while True:
            page = await ops.budgets("org:a/", cursor, 2)
            seen += [b["budget_id"] for b in page.items]
            assert len(page.items) <= 2
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == [f"org:a/team:t{i}" for i in range(5)]
        with pytest.raises(InvalidRequest):
            await ops.budgets(None, "!!not-a-cursor", 2)
        with pytest.raises(InvalidRequest):
            await ops.budgets(None, None, PAGE_SIZE_MAX + 1)
        new = await ops.create_key(BudgetId("org:b"), None, frozenset({Role.SIDECAR}), BY)
        await svc.authenticate(new.api_key)  # "last used" is written by a key check
        listed = (await ops.keys("org:b", None)).items
        assert [k["key_id"] for k in listed] == [new.key_id]
        assert listed[0]["roles"] == ["sidecar"]
        assert listed[0]["last_used_ms"]
        text = json.dumps(listed)
        assert new.api_key not in text
        assert new.record.key_hash not in text


async def test_rotation_keeps_the_old_secret_for_its_grace_and_revoke_ends_both(
        server: RedisServer) -> None:
    async with _instance(server.url) as (svc, ops):
        bid = await _put(ops, "org:r", 100)
        new = await ops.create_key(bid, None, frozenset({Role.SIDECAR}), BY)
        rotated = await ops.rotate_key(new.key_id, 60_000, BY)
        assert rotated["api_key"] != new.api_key
        assert key_id_of(rotated["api_key"]) == new.key_id
        # Both work during the grace period, straight from the ledger (no trust cache).
        assert await _taken(svc, new.api_key, rotated["api_key"]) == [True, True]
        assert (await ops.keys("org:r", None)).items[0]["previous_secret_valid_ms"] > 0
        assert await ops.revoke_key(new.key_id, BY)
        assert await _taken(svc, new.api_key, rotated["api_key"]) == [False, False]
        with pytest.raises(BudgetNotFound):
            await ops.rotate_key(new.key_id, 1000, BY)
        with pytest.raises(InvalidRequest):
            await ops.rotate_key(new.key_id, 10**12, BY)


async def test_delete_is_refused_under_open_holds_and_force_charges_them(
        server: RedisServer) -> None:
    async with _instance(server.url) as (svc, ops):
        parent = await _put(ops, "org:d", 1_000)
        child = await _put(ops, "org:d/team:x", 500)
        key = await ops.create_key(child, None, frozenset({Role.SIDECAR}), BY)
        held = await svc.store.reserve(_request(child, 120))
        with pytest.raises(BudgetInUse):
            await ops.delete_budget(child, False, BY)
        assert await svc.store.get_budget(child) is not None  # nothing changed
        done = await ops.delete_budget(child, True, BY)
        assert (done["reservations_charged_as_unknown"], done["charged_micros"]) == (1, 120)
        assert done["keys_revoked"] == [key.key_id]
        view = await svc.store.inspect(child.tag, held.reservation_id)
        assert view is not None
        assert (view.state, view.outcome) == (ReservationState.EXPIRED, "unknown")
        legs = {x.budget_id: x for x in await svc.store.status((parent,))}
        assert (legs["org:d"].committed_micros, legs["org:d"].reserved_micros) == (120, 0)
        with pytest.raises(Unauthorized):
            await svc.authenticate(key.api_key)
        # Re-created, it refills nothing: its counters stayed.
        await _put(ops, "org:d/team:x", 500)
        legs = {x.budget_id: x for x in await svc.store.status(child.lineage)}
        assert legs["org:d/team:x"].committed_micros == 120
        whats = [e["what"] for e in (await ops.audit_page(None)).items]
        assert whats[:3] == ["budget.put", "budget.delete", "key.create"]
        assert all(e["who"] == BY for e in (await ops.audit_page(None)).items)


async def test_export_then_restore_into_a_wiped_ledger(server: RedisServer) -> None:
    async with _instance(server.url) as (svc, ops):
        bid = await _put(ops, "org:e/team:x", 10_000)
        await _put(ops, "org:e", 20_000, outage_policy=OutagePolicy.OPEN)
        day = BudgetId.parse("org:f")
        await ops.put_budget(BudgetDef(day, (Limit(Period.DAY, 900),), "Europe/Paris"), BY)
        key = await ops.create_key(bid, None, frozenset({Role.SIDECAR}), BY)
        rotated = await ops.rotate_key(key.key_id, 600_000, BY)
        # A key made before the catalogue existed (and before records were by id): in no
        # index, and exported all the same.
        raw = aioredis.Redis.from_url(server.url, decode_responses=True)
        hash_only_id, hash_only_secret = await _hash_only_key(raw, bid)
        await raw.aclose()
        settled = await svc.store.reserve(_request(bid, 300))
        await svc.store.settle(ReservationRef(bid.tag, settled.reservation_id, "key_owner"), 250)
        open_one = await svc.store.reserve(_request(bid, 400))
        await svc.store.reserve(_request(day, 70))
        document = await ops.export(BY)
        old_id = document["ledger_id"]

    raw = aioredis.Redis.from_url(server.url, decode_responses=True)
    await raw.flushall()
    svc = await _service(server.url)  # a new instance on the wiped Redis: a fresh ledger id
    ops = _operations(svc)
    try:
        tampered = json.loads(json.dumps(document))
        tampered["body"]["organisations"][0]["counters"][0]["fields"]["committed"] = "0"
        with pytest.raises(InvalidRequest):
            await ops.restore(tampered, None, False, BY)
        assert await raw.exists(keys.ORGS_KEY) == 0  # nothing written
        bill = {"format": BILL_FORMAT, "entries": [
            {"budget_id": "org:e/team:x", "billed_micros": 1_000, "period": "total"}]}
        result = await ops.restore(document, bill, False, BY)
        assert result["ledger_id"] not in (old_id, None)
        assert result["open_reservations_charged_as_unknown"] == 2
        legs = {x.budget_id: x for x in await svc.store.status(bid.lineage)}
        # 250 settled + 400 held (charged as unknown), then the bill's 1000 - 650 booked.
        assert legs["org:e/team:x"].committed_micros == 1_000
        assert legs["org:e"].committed_micros == 1_000
        assert legs["org:e/team:x"].reserved_micros == 0
        assert (await svc.store.get_budget(BudgetId("org:e"))).policy is OutagePolicy.OPEN  # type: ignore[union-attr]
        day_legs = await svc.store.status((day,))
        assert day_legs[0].committed_micros == 70
        view = await svc.store.inspect(bid.tag, open_one.reservation_id)
        assert view is not None
        assert view.outcome == "unknown"
        # A late settle still corrects it, as after an expiry.
        await svc.store.settle(ReservationRef(bid.tag, open_one.reservation_id, "key_owner"), 100)
        legs = {x.budget_id: x for x in await svc.store.status(bid.lineage)}
        assert legs["org:e/team:x"].committed_micros == 700
        for key_id, secret in ((key.key_id, key.api_key), (key.key_id, rotated["api_key"]),
                               (hash_only_id, hash_only_secret)):
            assert (await svc.authenticate(secret, role=Role.SIDECAR)).key.key_id == key_id
        with pytest.raises(LedgerNotEmpty):
            await ops.restore(document, None, False, BY)
        # Forced, the larger committed of every counter stays: nothing refilled.
        await ops.restore(document, None, True, BY)
        legs = {x.budget_id: x for x in await svc.store.status(bid.lineage)}
        assert legs["org:e/team:x"].committed_micros == 700
    finally:
        await svc.store.close()
        await raw.aclose()


async def test_instances_adopt_a_restored_ledger_only_once_confirmed(server: RedisServer) -> None:
    svc = await _service(server.url)
    ops = _operations(svc)
    running = await _service(server.url)  # an instance that keeps running through the wipe
    try:
        bid = await _put(ops, "org:g", 1_000)
        await running.store.reserve(_request(bid, 10))
        document = await ops.export(BY)
        raw = aioredis.Redis.from_url(server.url, decode_responses=True)
        await raw.flushall()
        await raw.aclose()
        with pytest.raises(LedgerUnavailable):
            await running.store.reserve(_request(bid, 10))
        with pytest.raises(InvalidRequest):
            await ops.adopt(BY)  # nothing restored: a fresh id is never adopted
        await ops.restore(document, None, False, BY)
        with pytest.raises(LedgerUnavailable):
            await running.store.reserve(_request(bid, 10))  # restored, not yet confirmed
        await ops.adopt(BY)
        running.store._adopt_checked_s = -float("inf")  # type: ignore[attr-defined]
        got = await running.store.reserve(_request(bid, 10))
        assert got.legs[0].committed_micros == 10  # the first hold, charged as unknown
    finally:
        await svc.store.close()
        await running.store.close()


def test_checksum_covers_everything_but_itself() -> None:
    doc = {"format": "x", "body": {"a": 1}}
    signed = {**doc, "checksum": checksum(doc)}
    assert checksum(signed) == signed["checksum"]
    assert checksum({**signed, "body": {"a": 2}}) != signed["checksum"]


# -- keys: the layout before records were by id, and rotations cut short --------------------------

GRACE_MS = 60_000


async def _secrets_taken(store: ScriptedStore, key_id: str, *hashes: str) -> list[str]:
    """Of `hashes`, those the ledger takes now, as a secret that carries the key id or as one
    of the layout before (found by its hash alone)."""
    out = []
    for h in hashes:
        by_hash = await store.get_key(h)
        assert by_hash is None or by_hash.key_id == key_id
        if by_hash is not None or await store.get_key(h, key_id) is not None:
            out.append(h)
    return out


async def test_a_key_of_the_layout_before_records_migrated_is_its_record(
        server: RedisServer) -> None:
    raw = aioredis.Redis.from_url(server.url, decode_responses=True)
    async with _instance(server.url) as (svc, ops):
        bid = await _put(ops, "org:m", 100)
        key_id, secret = await _hash_only_key(raw, bid, roles="gateway,sidecar")
        # As that layout's rotation left it: the previous secret's entry expiring with its
        # pointer, and an entry one that did not finish left without either.
        previous, orphan = f"sk-ceil-{uuid.uuid4().hex}", f"sk-ceil-{uuid.uuid4().hex}"
        for old, ttl in ((previous, GRACE_MS), (orphan, None)):
            await raw.hset(keys.api_key(hash_api_key(old)), mapping={
                "key_id": key_id, "budget_id": bid.path, "run_ceiling_micros": "",
                "roles": "sidecar"})
            if ttl:
                await raw.pexpire(keys.api_key(hash_api_key(old)), ttl)
        await raw.set(keys.api_key_previous(key_id), hash_api_key(previous), px=GRACE_MS)
        await migrate(svc.store)
        assert await _taken(svc, secret, previous, orphan) == [True, True, False]
        rotated = (await ops.rotate_key(key_id, GRACE_MS, BY))["api_key"]
        assert key_id_of(rotated) == key_id
        # The record decides now: the new secret, the one it replaced for the grace; the one
        # before that is taken no more (one previous secret at a time), nor is the orphan.
        assert await _taken(svc, rotated, secret, previous, orphan) == [True, True, False, False]
        assert await raw.exists(keys.api_key_id(key_id), keys.api_key_previous(key_id)) == 0
        assert await raw.hget(keys.api_key(hash_api_key(secret)), "index_only") == "1"
        listed = (await ops.keys(bid.path, None)).items
        assert [(k["key_id"], k["roles"], k["created_ms"]) for k in listed] == [
            (key_id, ["gateway", "sidecar"], 1)]
        assert 0 < listed[0]["previous_secret_valid_ms"] <= GRACE_MS
        again = (await ops.rotate_key(key_id, 0, BY))["api_key"]
        assert await _taken(svc, again, rotated, secret, previous, orphan) == [
            True, False, False, False, False]
        assert await ops.revoke_key(key_id, BY)
        assert await _taken(svc, again, rotated, secret, previous, orphan) == [False] * 5
        assert not await ops.revoke_key(key_id, BY)

        # Revoked before it was migrated: nothing of it is taken, and neither the migration nor
        # a rotation brings it back.
        key_id, secret = await _hash_only_key(raw, bid)
        assert not await ops.revoke_key(key_id, BY)  # no record of it to revoke, but its id
        await migrate(svc.store)
        assert await _taken(svc, secret) == [False]
        with pytest.raises(BudgetNotFound):
            await ops.rotate_key(key_id, 0, BY)
        assert await _taken(svc, secret) == [False]
    await raw.aclose()


class LosingTransport:
    """A ledger connection lost at its `lose_at`th command from now on (`arm`): before the
    command reached the ledger, or after it ran there with its reply lost (a call timeout),
    which is what an instance sees at each point of a step cut short."""

    def __init__(self, inner: RedisTransport, *, reply_lost: bool) -> None:
        self.inner, self.reply_lost = inner, reply_lost
        self.backend = inner.backend
        self.sent, self.lose_at = 0, 0

    def arm(self, lose_after: int) -> None:
        self.lose_at = self.sent + lose_after

    @property
    def lost(self) -> bool:
        return self.sent >= self.lose_at

    async def _send(self, command: Callable[[], Awaitable[Any]]) -> Any:
        self.sent += 1
        losing = self.sent == self.lose_at
        if losing and not self.reply_lost:
            raise LedgerUnavailable("connection lost", reason="ledger_unreachable")
        reply = await command()
        if losing:
            raise LedgerUnavailable("no reply in time", reason="ledger_unreachable")
        return reply

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        return await self._send(lambda: self.inner.run(script, keys, args))

    async def execute(self, *args: str) -> Any:
        return await self._send(lambda: self.inner.execute(*args))

    async def durability(self) -> Durability:
        return await self.inner.durability()

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.parametrize("reply_lost", [False, True], ids=["before", "after"])
async def test_a_rotation_cut_short_anywhere_leaves_no_secret_taken_that_should_not_be(
        server: RedisServer, reply_lost: bool) -> None:
    """At every command of a rotation the connection is lost once. Afterwards either the
    rotation happened (the new secret and, for its grace, the old one) or it did not (the old
    secrets, as before); a rotation retried then leaves exactly its secret; a revoke, none."""
    clock = ManualClock()
    healthy = RedisStore(server.url, clock=clock)
    bid = BudgetId("org:cut")
    points = 0
    for lose_after in itertools.count(1):
        key_id, old = new_key_id(), "h" + uuid.uuid4().hex
        await healthy.put_key(KeyRecord(key_id, old, bid, None))
        transport = LosingTransport(RedisTransport(redis_client(server.url)),
                                    reply_lost=reply_lost)
        store = ScriptedStore(transport, clock=clock)
        await store.open()
        new, retried = "h" + uuid.uuid4().hex, "h" + uuid.uuid4().hex
        transport.arm(lose_after)
        try:
            await store.rotate_key(key_id, new, GRACE_MS)
        except LedgerUnavailable:
            pass
        finally:
            await store.close()
        taken = await _secrets_taken(healthy, key_id, new, old)
        assert taken in ([old], [new, old]), (lose_after, taken)
        if taken == [new, old]:
            clock.advance(GRACE_MS)  # the old secret's grace ends by the ledger's clock
            assert await _secrets_taken(healthy, key_id, new, old) == [new]
        assert await healthy.rotate_key(key_id, retried, 0)
        assert await _secrets_taken(healthy, key_id, retried, new, old) == [retried]
        assert await healthy.delete_key(key_id)
        assert await _secrets_taken(healthy, key_id, retried, new, old) == []
        if not transport.lost:
            break
        points += 1
    # Every command of the step was cut once: one script on the record.
    assert points >= 1
    await healthy.close()
