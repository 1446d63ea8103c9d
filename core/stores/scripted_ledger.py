"""The reservations of ScriptedStore (core/stores/scripted.py): the Ledger protocol's operations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from core.budgets import UNLISTED_MODEL
from core.errors import (
    BudgetNotFound,
    BudgetPaused,
    CeilingError,
    ConcurrencyLimited,
    IdempotencyConflict,
    ModelNotAllowed,
    RateLimited,
    ReservationNotFound,
    ReservationResolved,
    UserRequired,
    UsersExhausted,
    ensure,
    state_quota,
)
from core.ledger import (
    Correction,
    OpenHold,
    OpenLeases,
    Release,
    Reservation,
    ReservationRef,
    ReservationView,
    ReserveRequest,
    RunSpend,
    Settlement,
    Upstream,
    refusal,
    resolved_replay,
)
from core.lifecycle import Event
from core.stores import keys, wire
from core.stores.scripted_core import ScriptedCore, ledger_reset
from core.stores.scripts import script


def _holds(flat: Sequence[Any]) -> tuple[OpenHold, ...]:
    """open_listing.lua's {id, packed record, ...} as the protocol lists them."""
    out = []
    for rid, packed in zip(flat[::2], flat[1::2], strict=True):
        rec = wire.StoredRecord.unpacked(str(packed))
        legs = [leg.split(wire.PART_SEPARATOR) for leg in rec.legs.split(wire.ITEM_SEPARATOR)
                if leg]
        budgets = tuple(dict.fromkeys(p[0] for p in legs if p[-1] != "run"))
        run = next((p[0] for p in legs if p[-1] == "run"), None)
        out.append(OpenHold(str(rid), rec.owner, budgets, run, int(rec.reserved_micros),
                            int(rec.created_ms) if rec.created_ms else None,
                            int(rec.expires_at_ms)))
    return tuple(out)


def _runs(flat: Sequence[Any]) -> tuple[RunSpend, ...]:
    """open_listing.lua's {budget_id, ceiling, committed, reserved, seen_ms, ...}."""
    return tuple(
        RunSpend(str(flat[i]), int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                 int(flat[i + 4]) if str(flat[i + 4]) else None)
        for i in range(0, len(flat), 5))


_LIMIT_REFUSALS = ("user_required", "users_exhausted", "rate_limited", "concurrency_limited")


def _limit_refusal(kind: str, reply: Sequence[Any], user: str | None) -> CeilingError:
    """reserve.lua's refusal by a budget's end users or rates, naming the budget."""
    budget_id = str(reply[1])
    if kind == "user_required":
        return UserRequired(
            f"budget {budget_id!r} holds each end user to its own limits: name the call's user "
            "(X-Ceiling-User, or the provider's user field through the gateway)",
            budget_id=budget_id)
    if kind == "users_exhausted":
        return UsersExhausted(
            f"budget {budget_id!r} counts as many end users as its per_user users_max allows; "
            f"user {user!r} is not one of them", budget_id=budget_id, user=user)
    retry_after_s = int(reply[2])
    if kind == "rate_limited":
        return RateLimited(
            f"budget {budget_id!r} admitted all the requests its rate allows in the last minute",
            budget_id=budget_id, retry_after_s=retry_after_s)
    return ConcurrencyLimited(
        f"budget {budget_id!r} has all the calls open at once its rate allows",
        budget_id=budget_id, retry_after_s=retry_after_s)


def _model_not_allowed(budget_id: str, request: ReserveRequest) -> ModelNotAllowed:
    model = request.canonical_model
    if model == UNLISTED_MODEL:
        model = request.model  # a name no allow-list can hold: as the call priced it
    return ModelNotAllowed(
        f"budget {budget_id!r} allows its calls only the models its models.allow names, and "
        f"not {model!r}: nothing was held or forwarded. An operator adds the model to the "
        "list (PUT /v1/admin/budgets/{id})", budget_id=budget_id, model=model)


def _paused(budget_id: str) -> BudgetPaused:
    return BudgetPaused(
        f"budget {budget_id} was paused by its velocity alarm; an operator resumes it "
        "(ceiling budgets resume)", budget_id=budget_id)


def _resolved(reservation_id: str, reply: Sequence[Any]) -> CeilingError:
    """The error a repeat of a resolved reservation stands for."""
    found = wire.resolved(reply)
    return resolved_replay(reservation_id, found.state, found.outcome, found.reserved_micros,
                           found.charged_micros)


class ScriptedLedger(ScriptedCore):
    """The Ledger protocol's reservations (core/ledger.py): reserve, settle, release, book, read,
    correct, expire and list them."""

    async def reserve(self, request: ReserveRequest) -> Reservation:
        ledger_id = await self.open()
        ref = request.ref
        ensure(all(b.tag == ref.tag for b in request.budget_ids), "one tag per reservation")
        # The highest sequence of the tag acknowledged before this call began: Redis runs the
        # scripts one at a time, so this call's hold must come back above it (`_went_back`).
        seen = self._sequences
        floor = seen.get(ref.tag, 0)
        reply = await self._run_windowed(
            script("reserve"),
            self._record_keys(ref.tag, ref.reservation_id),
            {
                "ledger_id": ledger_id,
                "owner": ref.owner,
                "reserved_micros": str(request.amount_micros),
                "ttl_ms": str(request.ttl_ms),
                "expire_policy": request.expire_policy,  # a StrEnum is its value
                "retention_ms": str(request.retention_ms),
                "record_tail": wire.record_tail(request.fingerprint, request.price_version,
                                                request.model, request.bill or ""),
                "user": request.user or "",
                "model": request.canonical_model,
            },
            request.budget_ids,
            request.run,
        )
        kind = reply[0]
        if kind == "ok":
            sequence, reply = int(reply[-1]), reply[:-1]
            if sequence <= floor:
                await self._went_back(ref.tag, sequence, floor, seen)
            self._saw(ref.tag, sequence)
        if kind == "ok" or kind == "replayed":
            reservation = wire.reservation(ref.reservation_id, request.amount_micros,
                                           request.ttl_ms, reply)
            self._learn_now(reservation.now_ms)
            return reservation
        if kind in ("exceeded", "busy"):
            refused = wire.refused(reply)
            raise refusal(refused.kind, refused.leg, refused.now_ms)
        if kind == "resolved":
            raise _resolved(ref.reservation_id, reply)
        if kind == "paused":
            raise _paused(str(reply[1]))
        if kind == "state_quota":
            raise state_quota(str(reply[1]), int(reply[2]))
        if kind in _LIMIT_REFUSALS:
            raise _limit_refusal(kind, reply, request.user)
        if kind == "model_not_allowed":
            raise _model_not_allowed(str(reply[1]), request)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation id was used with other parameters",
                reservation_id=ref.reservation_id,
            )
        # A wiped ledger has no budgets: 'no_budget' may mean the ledger is gone.
        await self._lost_check(ref.tag)
        raise BudgetNotFound(
            "no budget applies to this call", budget_id=request.budget_ids[-1].path
        )

    async def settle(self, ref: ReservationRef, actual_micros: int,
                     upstream: Upstream | None = None) -> Settlement:
        await self.open()  # a ledger known to be reset fails closed before it is asked
        reply = await self._t.run(
            script("settle"), self._record_keys(ref.tag, ref.reservation_id),
            wire.arguments(wire.SETTLE_ARGS, owner=ref.owner, actual_micros=str(actual_micros),
                           upstream=upstream or "", now_ms=self._now_arg()),
        )
        kind = reply[0]
        if kind == "ok" or kind == "replayed":
            return wire.settlement(reply, actual_micros)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation was settled before with another amount",
                reservation_id=ref.reservation_id,
            )
        if kind == "released":
            raise ReservationResolved(
                "this reservation was released; it cannot be settled",
                reservation_id=ref.reservation_id,
            )
        await self._not_found(ref.reservation_id, ref.tag)

    async def release(self, ref: ReservationRef) -> Release:
        await self.open()
        reply = await self._t.run(
            script("release"), self._record_keys(ref.tag, ref.reservation_id),
            wire.arguments(wire.RELEASE_ARGS, owner=ref.owner, now_ms=self._now_arg()),
        )
        kind = reply[0]
        if kind == "ok" or kind == "replayed":
            return wire.release(reply)
        if kind == "settled":
            raise ReservationResolved(
                "this reservation was settled; it cannot be released",
                reservation_id=ref.reservation_id,
            )
        await self._not_found(ref.reservation_id, ref.tag)

    async def book(self, request: ReserveRequest, actual_micros: int, admitted_at_ms: int) -> bool:
        ledger_id = await self.open()
        ref = request.ref
        reply = await self._run_windowed(
            script("book"),
            (keys.meta(ref.tag), keys.reservation(ref.tag, ref.reservation_id)),
            {
                "ledger_id": ledger_id,
                "admitted_at_ms": str(admitted_at_ms),
                "owner": ref.owner,
                "reserved_micros": str(request.amount_micros),
                "actual_micros": str(actual_micros),
                "record_tail": wire.record_tail(request.fingerprint, request.price_version,
                                                request.model, request.bill or ""),
                "user": request.user or "",
                "model": request.canonical_model,
            },
            request.budget_ids, request.run, now_ms=admitted_at_ms,
        )
        if reply[0] == "ok":
            return bool(reply[1] == 0)
        await self._lost_check(ref.tag)
        raise BudgetNotFound("no budget applies to this journal entry")

    async def _read(self, tag: str, reservation_id: str) -> wire.StoredRecord | None:
        await self.open()
        reply = await self._t.run(
            script("read"), self._record_keys(tag, reservation_id)[:2],
            wire.arguments(wire.READ_ARGS, now_ms=self._now_arg()),
        )
        return wire.StoredRecord.unpacked(str(reply[1])) if reply[0] == "found" else None

    async def read_record(self, tag: str, reservation_id: str) -> wire.StoredRecord | None:
        return await self._read(tag, reservation_id)

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        found = await self._read(ref.tag, ref.reservation_id)
        if found is None:
            await self._lost_check(ref.tag)
        if found is None or found.owner != ref.owner:
            return None
        return found.view(ref.reservation_id, full=False)

    async def inspect(self, tag: str, reservation_id: str) -> ReservationView | None:
        found = await self._read(tag, reservation_id)
        if found is None:
            await self._lost_check(tag)
            return None
        return found.view(reservation_id, full=True)

    async def correct(
        self, tag: str, reservation_id: str, actual_micros: int, correction: Correction
    ) -> Settlement:
        await self.open()
        reply = await self._t.run(
            script("correct"), self._record_keys(tag, reservation_id),
            wire.arguments(wire.CORRECT_ARGS, actual_micros=str(actual_micros),
                           corrected_by=correction.corrected_by,
                           correction_reason=wire.escaped(correction.reason),
                           now_ms=self._now_arg()),
        )
        kind = reply[0]
        if kind == "ok" or kind == "replayed":
            return wire.settlement(reply, actual_micros, Event.CORRECT)
        if kind == "resolved":
            raise _resolved(reservation_id, reply)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation was corrected before to another amount",
                reservation_id=reservation_id,
            )
        await self._not_found(reservation_id, tag)

    async def tag_of(self, digest: str) -> str | None:
        await self.open()
        found = await self._t.execute("HGET", keys.TAG_MAP_KEY, digest)
        return None if found is None else str(found)

    async def _lost_check(self, tag: str) -> None:
        """A reservation or budget that is not found may be one a wiped ledger (or shard) lost:
        then the answer is ledger_reset, never "not found" (settle, release, correction and the
        reads check no ledger id in their scripts; a wiped ledger has no budgets)."""
        if await self._identity_lost():
            raise self._refusal()
        if await self._org_lost(tag):
            raise ledger_reset(tag)

    async def _not_found(self, reservation_id: str, tag: str) -> NoReturn:
        await self._lost_check(tag)
        raise ReservationNotFound("no such reservation", reservation_id=reservation_id)

    async def expire(self, tag: str, batch_max: int) -> int:
        ledger_id = await self.open()
        reply = await self._t.run(
            script("expire"), (keys.meta(tag), keys.open_leases(tag)),
            wire.arguments(wire.EXPIRE_ARGS, ledger_id=ledger_id, batch_max=str(batch_max),
                           now_ms=self._now_arg()),
        )
        if reply[0] == "ok":
            return int(reply[1])
        if await self._identity_lost():
            raise self._refusal()
        return 0

    async def open_listing(self, tag: str, listed_max: int, examined_max: int) -> OpenLeases:
        """lua/open_listing.lua: one read of the tag's open leases, their records and the run
        counters they hold in."""
        ensure(listed_max >= 1 and examined_max >= 1, "an open listing lists something")
        await self.open()
        reply = await self._t.run(
            script("open_listing"), (keys.meta(tag), keys.open_leases(tag)),
            [str(listed_max), str(examined_max), *filter(None, [self._now_arg()])])
        now_ms, open_count, overdue_count, overdue, within, runs = reply
        return OpenLeases(tag, int(now_ms), int(open_count), int(overdue_count),
                          _holds(overdue), _holds(within), _runs(runs))
