"""What a gateway call is charged once the provider has answered, without servers.

The end-to-end tests (test_gateway.py) drive these through the stub provider; what the stub
cannot do today (answer without usage) is proved here, on a real ledger store.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from core import gateway
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.formats import Api
from core.gateway import Call, Hold, Outcome, OutputLengths, billed_nothing, hold
from core.gateway_request import plan
from core.ledger import LedgerStore, Role
from core.prices import PriceTable, Usage
from core.service import Caller, CeilingService


@pytest.mark.parametrize(("status", "released"), [
    (400, True), (401, True), (403, True), (404, True), (409, True), (422, True), (429, True),
    (408, False), (499, False), (500, False), (502, False), (503, False), (504, False),
    (520, False), (522, False), (524, False), (599, False), (302, False),
])
def test_only_the_providers_own_refusal_proves_nothing_was_billed(
    status: int, released: bool
) -> None:
    assert billed_nothing(status) is released


async def gateway_call(store: LedgerStore, tag: str, *, p95_tokens: int | None = None
                       ) -> tuple[CeilingService, Caller, Hold]:
    service = CeilingService(store, PriceTable.from_file(None))
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10_000_000),)))
    key = await service.create_key(BudgetId(tag), None)
    who = await service.authenticate(key.api_key, role=Role.GATEWAY)
    call_plan = plan(Api.CHAT, json.dumps({
        "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1_000}).encode())
    lengths = OutputLengths()
    if p95_tokens is not None:
        for _ in range(60):
            await store.observe_output("gpt-4o", p95_tokens)
    held = await hold(service, who, call_plan, lengths, clamp=False, p95=p95_tokens is not None)
    return service, who, held


async def test_a_complete_answer_without_usage_is_charged_its_worst_case(
    store: LedgerStore, tag: str
) -> None:
    service, who, held = await gateway_call(store, tag)
    worst = service.worst_case_micros(held.plan.spec())[0]
    assert held.reservation.reserved_micros == worst
    bill = await Call(service, who, held, OutputLengths()).settle(None)
    # Not an estimate from the visible answer: hidden reasoning tokens can exceed it.
    assert (bill.charged_micros, bill.outcome) == (worst, Outcome.ESTIMATED)
    legs = await service.my_budgets(who)
    assert (legs[0].committed_micros, legs[0].reserved_micros) == (worst, 0)


async def test_a_p95_hold_without_usage_is_charged_the_whole_worst_case(
    store: LedgerStore, tag: str
) -> None:
    service, who, held = await gateway_call(store, f"{tag}p", p95_tokens=20)
    worst = service.worst_case_micros(held.plan.spec())[0]
    assert held.reservation.reserved_micros < worst  # held at the model's p95
    bill = await Call(service, who, held, OutputLengths()).settle(None)
    assert bill.charged_micros == worst


async def test_a_complete_answer_with_usage_is_charged_its_usage(
    store: LedgerStore, tag: str
) -> None:
    service, who, held = await gateway_call(store, tag)
    bill = await Call(service, who, held, OutputLengths()).settle(Usage(10, 5))
    assert (bill.charged_micros, bill.outcome) == (
        service.prices.cost_micros("gpt-4o", Usage(10, 5)), Outcome.BILLED)
    await asyncio.gather(*gateway._background)  # its output length, recorded on the side
