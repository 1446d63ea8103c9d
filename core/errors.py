"""The one error tree of spend-ceiling.

    CeilingError                    root of every error raised on purpose
    +-- InvalidRequest              bad input; nothing was reserved or written
    |   +-- InputUnbounded          input whose billed size the request cannot show (names it)
    |   +-- FieldUnsupported        a request field the gateway does not forward (names it)
    +-- ModelUnpriced               no price for the model; never priced at zero
    |   +-- ModelUnbounded          a price component the worst case cannot bound (names it)
    +-- Unauthorized / Forbidden    no valid key / a key outside its scope
    +-- BudgetNotFound              no budget applies to the call
    +-- BudgetRefused               the ledger said no
    |   +-- BudgetExceeded          committed spend leaves no room; retry after the reset
    |   +-- BudgetBusy              it would fit once open reservations settle
    |   +-- BudgetPaused            a velocity alarm paused it until an operator resumes it
    +-- StateQuota                  the key keeps all its quota allows; retry after the window
    +-- ReservationNotFound         unknown id, or another owner's
    +-- IdempotencyConflict         same id, other parameters
    +-- ReservationResolved         settle after release, release after settle
    +-- OperationRefused            an operator's change that would lose money (names why)
    |   +-- BudgetInUse             delete while open reservations hold money in the budget
    |   +-- LedgerNotEmpty          restore over a ledger that has data, without --force
    +-- UserRequired (InvalidRequest) a budget counts end users and the call named none
    +-- UsersExhausted              a new end user past the budget's users_max
    +-- ModelNotAllowed             a budget's models.allow does not name the call's model
    +-- RateLimited                 a budget's requests in the last minute are at its rate
    +-- ConcurrencyLimited          a budget's open reservations are at its concurrent_max
    +-- CostReportFailed            a provider's cost report could not be read whole
    +-- LedgerUnavailable           fail closed: unreachable, reset, or not shared
    +-- InvariantBroken             a programmer error; crashes loudly

Operating errors are values callers handle; InvariantBroken is not. Stores translate their
backend's exceptions into this tree; api/errors.py maps it to HTTP in one table.
"""

from __future__ import annotations

from typing import Any


class CeilingError(Exception):
    """Root of every error the core raises on purpose."""

    code = "ceiling_error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (worker pools, the fleet); keyword details must survive.
        return _rebuild, (type(self), self.message, self.details)


def _rebuild(cls: type[CeilingError], message: str, details: dict[str, Any]) -> CeilingError:
    error = cls.__new__(cls)
    CeilingError.__init__(error, message, **details)
    return error


class InvalidRequest(CeilingError):
    """Bad input, named in `field` where one is to blame; nothing was reserved or written."""

    code = "invalid_request"


class InputUnbounded(InvalidRequest):
    """The request carries input the provider bills by a size the request cannot show (a file
    or item referenced by id, an image for a model with no known per-image bound, a content
    type the gateway does not know). `field` names it as a JSON path, such as
    `messages[2].content[1].file`. Refused, never held at a guess."""

    code = "input_unbounded"


class FieldUnsupported(InvalidRequest):
    """A top-level request field that is not on the gateway route's allow-list: its billing
    effect is not known, so it is neither forwarded nor ignored. `field` names it."""

    code = "field_unsupported"


class ModelUnpriced(CeilingError):
    """No price for the model by its exact name (the bundled table, or the prices file): never
    priced at zero."""

    code = "model_unpriced"


class ModelUnbounded(ModelUnpriced):
    """The model's bill has a component (a fee, a rate) that no bound from the request covers.
    `component` names it; the call is refused rather than held without it."""

    code = "model_unbounded"


class Unauthorized(CeilingError):
    code = "unauthorized"  # no key, an unknown one, or a revoked one


class Forbidden(CeilingError):
    """A valid key outside its scope: a role it lacks (`missing_role`), or an admin route
    without the admin token."""

    code = "forbidden"


class BudgetNotFound(CeilingError):
    code = "budget_not_found"  # no budget applies to the call, or an admin route names none


class BudgetRefused(CeilingError):
    """The ledger refused a reservation; details name the budget and period that refused."""


class BudgetExceeded(BudgetRefused):
    """Committed spend leaves no room; retry after the period resets (`retry_after_s`, none
    for a total)."""

    code = "budget_exceeded"


class BudgetBusy(BudgetRefused):
    code = "budget_busy"  # it would fit once open reservations settle


class BudgetPaused(BudgetRefused):
    """A velocity alarm with pause stopped the budget; `ceiling budgets resume`."""

    code = "budget_paused"


class StateQuota(CeilingError):
    """An API key keeps all of one kind of state its quota allows (reservations kept for
    replays, runs, idempotency keys: core/limits.py); `quota` names it and `retry_after_s` says
    when its window ends. Nothing was reserved or written."""

    code = "state_quota"


def state_quota(kind: str, retry_after_s: int) -> StateQuota:
    what = {"records": "reservations kept for replays", "runs": "runs opened",
            "replies": "idempotency keys claimed"}.get(kind, kind)
    return StateQuota(
        f"this API key keeps all the {what} its quota allows in its window; nothing was reserved. "
        "Retry after the window ends, or spread the calls over more keys",
        quota=kind, retry_after_s=retry_after_s)


class UserRequired(InvalidRequest):
    """A budget on the key's path counts its end users (per_user, required), and the call named
    none: X-Ceiling-User, or through the gateway the provider's own user field."""

    code = "user_required"


class UsersExhausted(CeilingError):
    """The call's end user would be one more than its budget's per_user users_max; the users it
    counts already are served as before."""

    code = "users_exhausted"


class ModelNotAllowed(CeilingError):
    """A budget on the key's path allows its calls only some models (models.allow), and the
    call's model, by its one name (core/prices PriceTable.model_name), is not one of them:
    nothing was held or forwarded. Names the budget and the model."""

    code = "model_not_allowed"


class RateLimited(CeilingError):
    """A budget's (or its end user's) requests_per_minute were reserved in the last minute;
    `retry_after_s` says when the oldest of them leaves the window. Retryable, unlike
    budget_exceeded."""

    code = "rate_limited"


class ConcurrencyLimited(CeilingError):
    """A budget's (or its end user's) concurrent_max reservations are open; one frees up when a
    call settles, is released or its lease expires. Retryable."""

    code = "concurrency_limited"


class CostReportFailed(CeilingError):
    """A provider's cost report could not be read whole: the request failed or timed out, an
    error answer, a malformed page, an amount not in US dollars. Never read as zero spend;
    `provider` and `reason` (unreachable, http_status, malformed, currency, pages) say which."""

    code = "cost_report_failed"


class ReservationNotFound(CeilingError):
    code = "reservation_not_found"  # an unknown id, or another owner's


class IdempotencyConflict(CeilingError):
    """The same reservation id (or Idempotency-Key) with other parameters: a different call,
    never a retry."""

    code = "idempotency_conflict"


class ReservationResolved(CeilingError):
    code = "reservation_resolved"  # settle after release, release after settle, a late replay


class OperationRefused(CeilingError):
    """An operator's change refused because it would lose or refill money; nothing changed."""

    code = "operation_refused"


class BudgetInUse(OperationRefused):
    code = "budget_in_use"  # a delete while open reservations hold money in the budget


class LedgerNotEmpty(OperationRefused):
    """A restore over a ledger that has data, without --force: it would mix two ledgers'
    books."""

    code = "ledger_not_empty"


class LedgerUnavailable(CeilingError):
    """Fail closed. `reason` is one of: ledger_unreachable (no answer in time), ledger_error (an
    error reply), ledger_auth (credentials refused), ledger_reset (the ledger's data is gone),
    ledger_not_shared (no shared ledger configured)."""

    code = "ledger_unavailable"

    def __init__(self, message: str, *, reason: str, **details: Any) -> None:
        super().__init__(message, reason=reason, **details)

    @property
    def reason(self) -> str:
        return str(self.details["reason"])


class InvariantBroken(CeilingError):
    code = "invariant_broken"  # a programmer's error: crashes loudly, never a refusal


def ensure(condition: bool, why: str) -> None:
    """Check a programmer's invariant; unlike assert, survives `python -O`."""
    if not condition:
        raise InvariantBroken(why)
