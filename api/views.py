"""The JSON the routes and the CLI answer with: one home for each shape.

Plain functions of core's values, importing no web framework, so that the CLI answers in the
routes' shapes without importing the routes.
"""

from __future__ import annotations

from typing import Any

from core.budget_json import budget_json
from core.budgets import BudgetDef
from core.ledger import (
    GATEWAY_OWNER_PREFIX,
    LegStatus,
    Reservation,
    ReservationView,
    Role,
    Settlement,
    user_remaining_micros,
)
from core.money import micros_to_usd
from core.operations import UsersListing
from core.service import Caller
from core.spend import ModelSpend


def users_json(found: UsersListing) -> dict[str, Any]:
    """A page of a budget's end users: each with its legs as GET /v1/budgets/me shows them."""
    per_user = found.definition.per_user
    return {
        "budget_id": found.definition.budget_id.path,
        "users": [{"user": u.user, "budget_id": u.budget_id,
                   "budgets": [leg_json(x) for x in u.legs]} for u in found.page.users],
        "users_count": found.page.users_count,
        "users_max": per_user.users_max if per_user else None,
        "next_cursor": found.next_cursor,
    }


def budget_view_json(definition: BudgetDef, legs: tuple[LegStatus, ...],
                     models: tuple[ModelSpend, ...]) -> dict[str, Any]:
    """A budget as GET /v1/admin/budgets/{id} and `ceiling budgets show` answer: its definition
    (core/budget_json.py), its current windows (`periods`), and those of each model its
    per_model limits name (`per_model_periods`: {model: periods}, null for none), each in the
    periods' shape, read at one instant (core/spend.py budget_now): a model's committed spend is
    also its budget's."""
    return {**budget_json(definition), "periods": [leg_json(x) for x in legs],
            "per_model_periods": {m.model: [leg_json(x) for x in m.legs] for m in models}
            or None}


def user_headers(who: Caller, legs: tuple[LegStatus, ...]) -> dict[str, str]:
    """The end user's room, for a call that named one whose budget holds its users."""
    remaining = user_remaining_micros(legs, who.user)
    return {} if remaining is None else {"x-ceiling-user-remaining-micros": str(remaining)}


def leg_json(leg: LegStatus) -> dict[str, Any]:
    return {
        "budget_id": leg.budget_id,
        # A StrEnum is its value (.value costs a descriptor call per leg).
        "period": leg.period if leg.window_key != "outage" else "outage",
        "period_key": leg.window_key,
        "ceiling_micros": leg.ceiling_micros,
        "committed_micros": leg.committed_micros,
        "reserved_micros": leg.reserved_micros,
        "remaining_micros": leg.remaining_micros,
        "overshoot_micros": leg.overshoot_micros,
        "resets_at_ms": leg.resets_at_ms,
    }


def reservation_json(r: Reservation) -> dict[str, Any]:
    return {
        "reservation_id": r.reservation_id,
        "reserved_micros": r.reserved_micros,
        "reserved_usd": micros_to_usd(r.reserved_micros),
        "expires_at_ms": r.expires_at_ms,
        "replayed": r.replayed,
        "budgets": [leg_json(x) for x in r.legs],
    }


def settlement_json(reservation_id: str, s: Settlement) -> dict[str, Any]:
    return {
        "reservation_id": reservation_id,
        "charged_micros": s.charged_micros,
        "released_micros": s.released_micros,
        "overshoot_micros": s.overshoot_micros,
        "late": s.late,
        "replayed": s.replayed,
    }


def correction_json(reservation_id: str, s: Settlement, corrected_by: str) -> dict[str, Any]:
    """An operator's settle of a reservation (the admin route and `ceiling reservations
    settle`): the settlement, and who made it."""
    return {**settlement_json(reservation_id, s), "corrected_by": corrected_by}


def made_by(owner: str) -> tuple[str | None, Role]:
    """The key id a reservation was made under (None for none), and the route that made it:
    what its owner says, never a secret."""
    if owner.startswith(GATEWAY_OWNER_PREFIX):
        return owner.removeprefix(GATEWAY_OWNER_PREFIX) or None, Role.GATEWAY
    return owner or None, Role.SIDECAR


def stored_reservation_json(view: ReservationView) -> dict[str, Any]:
    key_id, route = made_by(view.owner)
    return {
        "reservation_id": view.reservation_id,
        "state": view.state.value,
        "outcome": view.outcome,
        "made_by": route.value,
        "key_id": key_id,
        "model": view.model,
        "price_version": view.price_version,
        "reserved_micros": view.reserved_micros,
        "charged_micros": view.charged_micros,
        "created_ms": view.created_ms,
        "expires_at_ms": view.expires_at_ms,
        "resolved_ms": view.resolved_ms,
        "corrected_by": view.corrected_by,
        "corrected_at_ms": view.corrected_at_ms,
        "corrected_from_micros": view.corrected_from_micros,
        "correction_reason": view.correction_reason,
    }
