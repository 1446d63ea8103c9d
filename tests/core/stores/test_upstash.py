"""What only the REST transport can get wrong: tokens, hangs, lost replies, forgotten scripts.

The ledger semantics on Upstash are the conformance suite's (the plugin registers the kind);
these tests drive the bridge's test faults, each armed for the next requests and disarmed after.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from core.budgets import Period
from core.errors import LedgerUnavailable
from core.ledger import LedgerStore, ReservationRef
from core.stores.scripts import library, script
from core.stores.upstash import UpstashStore
from infra.upstash_bridge import UpstashBridge
from tests.core.stores.test_conformance import OWNER, leg, put, request
from tests.support import ManualClock

# Short, so the test is quick; the production default is core.stores.upstash's.
HANG_CALL_TIMEOUT_S = 0.5
# Scheduling on a shared machine, not the transport: a call that fails closed at all fails
# within the timeout plus this.
TIMEOUT_SLACK_S = 2.0
# What a normal call through the bridge may take on that machine.
CALL_TIMEOUT_S = 10.0

OpenStore = Callable[..., UpstashStore]


class Faults:
    """The bridge's test faults: armed for the next requests, each request consuming one."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def arm(self, mode: str, requests: int) -> None:
        reply = await self._client.post(
            "/_bridge/fault", json={"mode": mode, "requests": requests}
        )
        reply.raise_for_status()

    async def armed(self) -> int:
        """Requests the armed fault has yet to hit."""
        reply = await self._client.get("/_bridge/fault")
        reply.raise_for_status()
        return int(reply.json()["result"]["requests"])


@pytest.fixture
async def faults(upstash_bridge: UpstashBridge) -> AsyncIterator[Faults]:
    """Disarmed after the test, so a fault a failed test left armed hits no other test."""
    async with httpx.AsyncClient(
        base_url=upstash_bridge.url,
        headers={"Authorization": f"Bearer {upstash_bridge.token}"},
        timeout=CALL_TIMEOUT_S,
    ) as client:
        faults = Faults(client)
        yield faults
        await faults.arm("none", 0)


@pytest.fixture
async def open_store(
    upstash_bridge: UpstashBridge, clock: ManualClock
) -> AsyncIterator[OpenStore]:
    """Builds UpstashStores on the bridge (the right token unless told) and closes them after."""
    stores: list[UpstashStore] = []

    def build(token: str = upstash_bridge.token, **options: float) -> UpstashStore:
        stores.append(UpstashStore(upstash_bridge.url, token, clock=clock, **options))
        return stores[-1]

    yield build
    for store in stores:
        await store.close()


async def test_a_wrong_token_is_a_configuration_error_at_probe(
    open_store: OpenStore, upstash_bridge: UpstashBridge
) -> None:
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as client:
        refused = await client.post(
            upstash_bridge.url, json=["GET", "k"], headers={"Authorization": "Bearer wrong"}
        )
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})

    store = open_store("wrong")
    probe = await store.probe("instance-1")
    assert (probe.backend, probe.reasons, probe.ledger_id) == ("upstash", ("ledger_auth",), None)
    with pytest.raises(LedgerUnavailable) as refusal:
        await store.open()
    assert refusal.value.reason == "ledger_auth"
    assert "token" in refusal.value.message


async def test_a_hung_bridge_fails_closed_within_the_timeout(
    open_store: OpenStore, faults: Faults, tag: str
) -> None:
    store = open_store(call_timeout_s=HANG_CALL_TIMEOUT_S)
    await put(store, tag, (Period.TOTAL, 1_000))
    await faults.arm("hang", 1)
    started_s = time.perf_counter()
    with pytest.raises(LedgerUnavailable) as refusal:
        await store.reserve(request(tag, tag, 100))
    elapsed_s = time.perf_counter() - started_s
    assert refusal.value.reason == "ledger_unreachable"
    assert elapsed_s < HANG_CALL_TIMEOUT_S + TIMEOUT_SLACK_S
    # The hung request never reached Redis, and the store works again once the bridge does.
    assert await faults.armed() == 0
    await store.reserve(request(tag, tag, 100))
    assert (await leg(store, tag)).reserved_micros == 100


async def test_a_library_the_server_forgot_is_loaded_again(
    open_store: OpenStore, upstash_bridge: UpstashBridge, tag: str
) -> None:
    store = open_store(call_timeout_s=CALL_TIMEOUT_S)
    await put(store, tag, (Period.TOTAL, 1_000))
    async with httpx.AsyncClient(
        headers={"Authorization": f"Bearer {upstash_bridge.token}"}, timeout=CALL_TIMEOUT_S
    ) as client:
        # As after a failover to a server that never loaded this version: FCALL finds nothing.
        flushed = await client.post(upstash_bridge.url, json=["FUNCTION", "FLUSH"])
        assert flushed.json() == {"result": "OK"}
        await store.reserve(request(tag, tag, 100))
        listed = await client.post(upstash_bridge.url, json=["FUNCTION", "LIST"])
    assert library().name in str(listed.json())
    assert (await leg(store, tag)).reserved_micros == 100


async def test_a_script_the_server_forgot_is_loaded_again(
    upstash_bridge: UpstashBridge, tag: str
) -> None:
    # A server without functions runs every call as a script of its own.
    store = UpstashStore(upstash_bridge.url, upstash_bridge.token,
                         call_timeout_s=CALL_TIMEOUT_S, functions=False)
    await put(store, tag, (Period.TOTAL, 1_000))
    async with httpx.AsyncClient(
        headers={"Authorization": f"Bearer {upstash_bridge.token}"}, timeout=CALL_TIMEOUT_S
    ) as client:
        # As after a failover to a server that never ran our scripts: EVALSHA finds nothing.
        flushed = await client.post(upstash_bridge.url, json=["SCRIPT", "FLUSH"])
        assert flushed.json() == {"result": "OK"}
        await store.reserve(request(tag, tag, 100))
        known = await client.post(
            upstash_bridge.url, json=["SCRIPT", "EXISTS", script("reserve").sha1]
        )
    assert known.json() == {"result": [1]}
    assert (await leg(store, tag)).reserved_micros == 100
    await store.close()


async def _warm(store: LedgerStore, tag: str) -> None:
    """One reserve and settle, so the scripts are loaded and a fault hits the EVALSHA itself."""
    r = await store.reserve(request(tag, tag, 1))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 1)


async def test_a_request_replayed_after_a_lost_reply_charges_once(
    open_store: OpenStore, faults: Faults, tag: str
) -> None:
    store = open_store(call_timeout_s=CALL_TIMEOUT_S)
    await put(store, tag, (Period.TOTAL, 1_000))
    await _warm(store, tag)

    await faults.arm("drop_reply", 1)
    reserve = request(tag, tag, 100)
    reservation = await store.reserve(reserve)
    assert await faults.armed() == 0, "the reply was dropped"
    # The SDK sent it again, and the script found the reservation the lost reply was about.
    assert reservation.replayed
    assert (await leg(store, tag)).reserved_micros == 100

    await faults.arm("drop_reply", 1)
    settlement = await store.settle(reserve.ref, 60)
    assert await faults.armed() == 0, "the reply was dropped"
    assert (settlement.replayed, settlement.charged_micros) == (True, 60)
    books = await leg(store, tag)
    assert (books.committed_micros, books.reserved_micros) == (1 + 60, 0)


async def test_replies_lost_beyond_the_replay_fail_closed_and_hold_once(
    open_store: OpenStore, faults: Faults, tag: str
) -> None:
    store = open_store(call_timeout_s=CALL_TIMEOUT_S)
    await put(store, tag, (Period.TOTAL, 1_000))
    await _warm(store, tag)

    await faults.arm("drop_reply", 2)
    reserve = request(tag, tag, 100)
    with pytest.raises(LedgerUnavailable) as refusal:
        await store.reserve(reserve)
    assert refusal.value.reason == "ledger_unreachable"
    # The caller was refused, yet both attempts ran: the hold is there once, and the caller's
    # retry with the same id gets it instead of holding again.
    assert (await leg(store, tag)).reserved_micros == 100
    assert (await store.reserve(reserve)).replayed
    assert (await leg(store, tag)).reserved_micros == 100
