"""The service: bad input is refused with a typed error before the ledger is touched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import (
    BudgetExceeded,
    Forbidden,
    IdempotencyConflict,
    InvalidRequest,
    ModelUnpriced,
    ReservationNotFound,
    ReservationResolved,
    Unauthorized,
)
from core.ledger import (
    GATEWAY_OWNER_PREFIX,
    ExpirePolicy,
    LedgerStore,
    Reservation,
    ReservationState,
    ReserveRequest,
    Role,
    tag_digest,
    tag_digest_of,
)
from core.limits import IDEMPOTENCY_WINDOW_MS, REPLAY_WINDOW_MS, RESEND_WINDOW_MS
from core.prices import PriceTable, Usage
from core.service import (
    KEY_TRUST_MS,
    Caller,
    CallSpec,
    CeilingService,
    SettleSpec,
    operator_fingerprint,
)
from tests.support import ManualClock


@pytest.fixture
def service(store: LedgerStore, tmp_path: Path) -> CeilingService:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {"acme-llm": {
        "input_usd_per_mtok": "1.00", "output_usd_per_mtok": "2.00"}}}))
    return CeilingService(store, PriceTable.from_file(str(path)))


async def caller_for(service: CeilingService, tag: str, ceiling_micros: int = 10_000) -> Caller:
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, ceiling_micros),)))
    key = await service.create_key(BudgetId(f"{tag}/key:k"), run_ceiling_micros=None)
    return await service.authenticate(key.api_key)


async def books(service: CeilingService, caller: Caller) -> tuple[int, int]:
    legs = await service.my_budgets(caller)
    return legs[0].committed_micros, legs[0].reserved_micros


BAD_SPECS: list[dict[str, Any]] = [
    {"model": "acme-llm", "input_tokens": -1, "output_tokens_max": 10},
    {"model": "acme-llm", "input_tokens": 0, "output_tokens_max": 0},
    {"model": "acme-llm", "input_tokens": 1.5, "output_tokens_max": 10},
    {"model": "acme-llm", "input_tokens": 10**12, "output_tokens_max": 10},
    {"model": "acme-llm", "input_tokens": 10, "output_tokens_max": "10"},
    {"model": "acme-llm", "input_tokens": 10, "output_tokens_max": True},
    {"model": "acme-llm", "input_tokens": 10},
    {"model": "acme-llm", "input_tokens": 10, "output_tokens_max": 10, "choices": 0},
    {"model": "acme-llm", "output_tokens_max": 10},
    {"model": "acme-llm", "input_tokens": 1, "messages": [{"a": 1}], "output_tokens_max": 10},
    {"model": "", "input_tokens": 10, "output_tokens_max": 10},
    {"amount_micros": 0},
    {"amount_micros": -5},
    {"amount_micros": 1.5},
    {"amount_micros": "5"},
    {"amount_micros": 2**53},
    {"amount_micros": 10, "model": "acme-llm"},
    {"amount_micros": 10, "ttl_ms": 10},
    {"amount_micros": 10, "ttl_ms": 10**9},
    {},
]


@pytest.mark.parametrize("spec", BAD_SPECS)
async def test_bad_input_is_refused_and_changes_nothing(
    service: CeilingService, tag: str, spec: dict[str, Any]
) -> None:
    caller = await caller_for(service, tag)
    with pytest.raises(InvalidRequest):
        await service.reserve(caller, CallSpec(**spec))
    assert await books(service, caller) == (0, 0)


async def test_an_unpriced_model_is_refused_and_changes_nothing(
    service: CeilingService, tag: str
) -> None:
    caller = await caller_for(service, tag)
    with pytest.raises(ModelUnpriced):
        await service.reserve(caller, CallSpec("no-such-model", 10, output_tokens_max=10))
    assert await books(service, caller) == (0, 0)


@pytest.mark.parametrize("bad", ["", "a" * 129, "with space", "tab\t", "é"])
async def test_bad_idempotency_keys_are_refused(
    service: CeilingService, tag: str, bad: str
) -> None:
    caller = await caller_for(service, tag)
    with pytest.raises(InvalidRequest):
        await service.reserve(caller, CallSpec(amount_micros=5), idempotency_key=bad)
    assert await books(service, caller) == (0, 0)


async def test_price_reserve_settle_by_tokens(service: CeilingService, tag: str) -> None:
    caller = await caller_for(service, tag)
    r = await service.reserve(caller, CallSpec("acme-llm", 1_000, output_tokens_max=500, choices=2))
    assert r.reserved_micros == 1_000 + 2 * 500 * 2
    s = await service.settle(caller, r.reservation_id, SettleSpec(Usage(1_000, 300)))
    assert (s.charged_micros, s.released_micros) == (1_600, 1_400)
    assert await books(service, caller) == (1_600, 0)


async def test_a_settle_by_tokens_from_another_instance_reads_the_model(
    service: CeilingService, store: LedgerStore, tag: str
) -> None:
    caller = await caller_for(service, tag)
    r = await service.reserve(caller, CallSpec("acme-llm", 100, output_tokens_max=100))
    other_instance = CeilingService(store, service.prices)
    s = await other_instance.settle(caller, r.reservation_id, SettleSpec(Usage(100, 50)))
    assert s.charged_micros == 200


async def test_messages_are_bounded_by_their_bytes(service: CeilingService, tag: str) -> None:
    caller = await caller_for(service, tag)
    msgs = [{"role": "user", "content": "x" * 400}]
    r = await service.reserve(caller, CallSpec("acme-llm", messages=msgs, output_tokens_max=1))
    assert r.reserved_micros >= 400 + 2


async def test_an_idempotency_key_makes_a_retry_return_the_first_reservation(
    service: CeilingService, tag: str
) -> None:
    caller = await caller_for(service, tag)
    first = await service.reserve(caller, CallSpec(amount_micros=70), idempotency_key="call-1")
    again = await service.reserve(caller, CallSpec(amount_micros=70), idempotency_key="call-1")
    assert again.reservation_id == first.reservation_id
    assert again.replayed
    assert await books(service, caller) == (0, 70)
    with pytest.raises(IdempotencyConflict):
        await service.reserve(caller, CallSpec(amount_micros=71), idempotency_key="call-1")


async def test_keys_authenticate_and_revoke(service: CeilingService, tag: str) -> None:
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10),)))
    key = await service.create_key(BudgetId(tag), run_ceiling_micros=5)
    assert key.api_key.startswith("sk-ceil-")
    caller = await service.authenticate(key.api_key, run_id="run-1")
    assert caller.run_limit() is not None
    for bad in (None, "", "sk-ceil-wrong", key.api_key + "x", "Bearer " + key.api_key):
        with pytest.raises(Unauthorized):
            await service.authenticate(bad)
    with pytest.raises(InvalidRequest):
        await service.authenticate(key.api_key, run_id="bad run id")
    assert await service.revoke_key(key.key_id)
    with pytest.raises(Unauthorized):
        await service.authenticate(key.api_key)


async def test_a_key_needs_an_existing_budget(service: CeilingService, tag: str) -> None:
    with pytest.raises(InvalidRequest):
        await service.create_key(BudgetId(f"{tag}/key:nobody"), run_ceiling_micros=None)


async def test_a_run_has_its_own_ceiling(service: CeilingService, tag: str) -> None:
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 1_000),)))
    key = await service.create_key(BudgetId(tag), run_ceiling_micros=100)
    run_a = await service.authenticate(key.api_key, run_id="a")
    run_b = await service.authenticate(key.api_key, run_id="b")
    await service.reserve(run_a, CallSpec(amount_micros=100))
    r = await service.reserve(run_b, CallSpec(amount_micros=100))
    await service.settle(run_b, r.reservation_id, SettleSpec(actual_micros=100))
    with pytest.raises(BudgetExceeded) as info:
        await service.reserve(run_b, CallSpec(amount_micros=1))
    assert info.value.details["budget_id"] == f"{tag}/run:b"


@pytest.mark.parametrize("rid", ["", "a{b}", "../x", "a b", "x" * 129])
async def test_malformed_reservation_ids_are_not_found(
    service: CeilingService, tag: str, rid: str
) -> None:
    caller = await caller_for(service, tag)
    with pytest.raises(ReservationNotFound):
        await service.settle(caller, rid, SettleSpec(actual_micros=1))


async def test_an_amount_reservation_settles_only_by_amount(
    service: CeilingService, tag: str
) -> None:
    caller = await caller_for(service, tag)
    r = await service.reserve(caller, CallSpec(amount_micros=50))
    with pytest.raises(InvalidRequest):
        await service.settle(caller, r.reservation_id, SettleSpec(Usage(1, 1)))
    with pytest.raises(InvalidRequest):
        await service.settle(caller, r.reservation_id, SettleSpec(Usage(1, 1), 5))
    with pytest.raises(InvalidRequest):
        await service.settle(caller, r.reservation_id, SettleSpec(actual_micros=-1))
    assert await books(service, caller) == (0, 50)


async def test_a_key_revoked_elsewhere_is_refused_once_its_trust_runs_out(
    store: LedgerStore, service: CeilingService, tag: str
) -> None:
    now = [0]
    instance = CeilingService(store, service.prices, monotonic_ms=lambda: now[0])
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10),)))
    key = await service.create_key(BudgetId(tag), run_ceiling_micros=None)
    await instance.authenticate(key.api_key)
    assert await service.revoke_key(key.key_id)  # on another instance
    now[0] += KEY_TRUST_MS - 1
    await instance.authenticate(key.api_key)  # still trusted: checked under a second ago
    now[0] += 1
    with pytest.raises(Unauthorized):
        await instance.authenticate(key.api_key)


# -- roles, owners, corrections ------------------------------------------------------------------


async def test_a_key_acts_only_in_its_roles(service: CeilingService, tag: str) -> None:
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10),)))
    default = await service.create_key(BudgetId(tag), None)
    assert default.record.roles == {Role.GATEWAY}
    with pytest.raises(Forbidden) as refused:
        await service.authenticate(default.api_key, role=Role.SIDECAR)
    assert refused.value.details == {"missing_role": "sidecar"}
    gateway = await service.authenticate(default.api_key, role=Role.GATEWAY)
    assert gateway.owner == GATEWAY_OWNER_PREFIX + default.key_id
    both = await service.create_key(BudgetId(tag), None, frozenset(Role))
    sidecar = await service.authenticate(both.api_key, role=Role.SIDECAR)
    assert sidecar.owner == both.key_id
    for bad in ([], ["admin"], "sidecar", [1]):
        with pytest.raises(InvalidRequest):
            await service.create_key(BudgetId(tag), None, bad)  # type: ignore[arg-type]


async def test_a_gateway_reservation_belongs_to_no_key_and_always_expires_charged(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    # CEILING_EXPIRE_POLICY=release applies to sidecar calls only.
    service = CeilingService(store, PriceTable.from_file(None), expire_policy=ExpirePolicy.RELEASE)
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 1_000),)))
    key = await service.create_key(BudgetId(tag), None, frozenset(Role))
    as_gateway = await service.authenticate(key.api_key, role=Role.GATEWAY)
    as_sidecar = await service.authenticate(key.api_key, role=Role.SIDECAR)
    call = await service.reserve(as_gateway, CallSpec(amount_micros=100, ttl_ms=1_000))
    own = await service.reserve(as_sidecar, CallSpec(amount_micros=50, ttl_ms=1_000))
    with pytest.raises(ReservationNotFound):
        await service.release(as_sidecar, call.reservation_id)
    with pytest.raises(ReservationNotFound):
        await service.settle(as_sidecar, call.reservation_id, SettleSpec(actual_micros=0))
    clock.advance(1_000)
    assert await store.expire(tag, 10) == 2
    gateway_call = await service.inspect(call.reservation_id)
    sidecar_call = await service.inspect(own.reservation_id)
    assert (gateway_call.outcome, sidecar_call.outcome) == ("unknown", "released")
    assert await books(service, as_gateway) == (100, 0)


async def test_an_operator_finds_a_reservation_by_its_id_and_corrects_it(
    service: CeilingService, tag: str
) -> None:
    caller = await caller_for(service, tag)
    r = await service.reserve(caller, CallSpec(amount_micros=100))
    assert tag_digest_of(r.reservation_id) == tag_digest(tag)
    by = operator_fingerprint("a-long-random-admin-token")
    assert "a-long-random-admin-token" not in by
    settled = await service.correct(r.reservation_id, 60, "invoice 7", by)
    assert (settled.charged_micros, settled.released_micros) == (60, 40)
    view = await service.inspect(r.reservation_id)
    assert (view.state, view.corrected_by, view.correction_reason) == (
        ReservationState.SETTLED, by, "invoice 7")
    assert await books(service, caller) == (60, 0)
    # An id that names no tag is found by no one: the error says what the migration counts.
    for untagged in ("0123456789abcdef0123456789abcdef", f"r{r.reservation_id}"):
        with pytest.raises(ReservationNotFound) as found:
            await service.inspect(untagged)
        assert "reservations_without_tag" in found.value.message
        with pytest.raises(ReservationNotFound):
            await service.correct(untagged, 60, "invoice 7", by)
    # A well-formed id of an organisation with no budget put names no tag this ledger knows.
    with pytest.raises(ReservationNotFound):
        await service.inspect(f"{tag_digest('org:nobody-' + tag)}_{'0' * 32}")
    for reason in ("", "   ", "x" * 501, "line\nbreak", 5):
        with pytest.raises(InvalidRequest):
            await service.correct(r.reservation_id, 60, reason, by)
    for amount in (-1, 1.5, "60", 10**13):
        with pytest.raises(InvalidRequest):
            await service.correct(r.reservation_id, amount, "why", by)


async def test_a_replayed_reserve_of_a_settled_call_is_not_a_new_hold(
    service: CeilingService, tag: str
) -> None:
    caller = await caller_for(service, tag)
    first = await service.reserve(caller, CallSpec(amount_micros=70), idempotency_key="call-9")
    await service.settle(caller, first.reservation_id, SettleSpec(actual_micros=20))
    with pytest.raises(ReservationResolved) as replay:
        await service.reserve(caller, CallSpec(amount_micros=70), idempotency_key="call-9")
    assert (replay.value.details["state"], replay.value.details["charged_micros"]) == (
        "settled", 20)
    assert await books(service, caller) == (20, 0)


@pytest.mark.parametrize(("role", "idempotency_key", "kept_ms"), [
    (Role.GATEWAY, None, RESEND_WINDOW_MS),
    (Role.SIDECAR, None, REPLAY_WINDOW_MS),
    (Role.SIDECAR, "call-1", IDEMPOTENCY_WINDOW_MS),
])
async def test_a_record_is_kept_as_long_as_its_kind_of_call_needs_it(
    service: CeilingService, store: LedgerStore, tag: str, monkeypatch: pytest.MonkeyPatch,
    role: Role, idempotency_key: str | None, kept_ms: int,
) -> None:
    caller = await caller_for(service, tag)
    caller = Caller(caller.key, None, role)
    made: list[ReserveRequest] = []
    reserve = store.reserve

    async def recording(request: ReserveRequest) -> Reservation:
        made.append(request)
        return await reserve(request)

    monkeypatch.setattr(store, "reserve", recording)
    await service.reserve(caller, CallSpec(amount_micros=5), idempotency_key)
    assert [(r.retention_ms, bool(r.fingerprint)) for r in made] == [
        (kept_ms, idempotency_key is not None)]
