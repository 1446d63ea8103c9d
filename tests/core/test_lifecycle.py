"""The lifecycle table: the rule it states, and the copy of it beside the Lua."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.ledger import ExpirePolicy, ReservationState
from core.lifecycle import (
    ABSENT,
    HOLDINGS,
    TRANSITIONS,
    Event,
    Outcome,
    charged_micros,
    effects,
    step,
)

README = Path(__file__).parents[2] / "lua" / "README.md"


def table(name: str) -> list[list[str]]:
    text = README.read_text()
    found = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", text, re.DOTALL)
    assert found is not None, f"lua/README.md has a {name} table"
    rows = [line.strip().strip("|").split("|") for line in found.group(1).strip().splitlines()]
    return [[cell.strip() for cell in row] for row in rows[2:]]  # past the header and rule


def test_the_tables_beside_the_lua_are_the_lifecycles() -> None:
    assert table("holdings") == [
        [state, policy, *holding] for (state, policy), holding in HOLDINGS.items()]
    assert table("transitions") == [
        [event, state, policy, row.to, row.outcome] for (event, state, policy), row
        in TRANSITIONS.items()]


@pytest.mark.parametrize(("event", "state", "policy"), list(TRANSITIONS))
@pytest.mark.parametrize("actual", [0, 30, 100, 130])
def test_every_step_moves_the_holdings_and_never_below_zero(
    event: Event, state: str, policy: ExpirePolicy, actual: int
) -> None:
    held = 100
    fx = effects(event, state, policy, held, actual)
    before = charged_micros(state, policy, held, actual)
    assert fx.charged_micros == charged_micros(fx.to, policy, held, actual)
    assert fx.committed_delta == fx.charged_micros - before
    # What a leg holds for the reservation stays between nothing and what it was moved to.
    reserved_before = held if state == ReservationState.OPEN else 0
    assert reserved_before + fx.reserved_delta >= 0
    assert before + fx.committed_delta >= 0
    # Charged beyond what was held is overshoot; what was held and not charged, released.
    assert fx.overshoot_micros >= 0
    assert fx.released_micros >= 0
    assert fx.late is (state == ReservationState.EXPIRED or event is Event.BOOK)


def test_what_has_no_row_is_refused_and_what_resolves_has_an_outcome() -> None:
    assert step(Event.SETTLE, ReservationState.RELEASED, ExpirePolicy.CHARGE) is None
    assert step(Event.CORRECT, ReservationState.EXPIRED, ExpirePolicy.RELEASE) is None
    assert step(Event.RESERVE, ReservationState.OPEN, ExpirePolicy.CHARGE) is None
    assert {row.outcome for (event, state, _), row in TRANSITIONS.items()
            if state == ABSENT and event is Event.RESERVE} == {Outcome.NONE}
    assert all(row.outcome for (event, _, _), row in TRANSITIONS.items()
               if event is not Event.RESERVE)
