"""Errors on Anthropic's Messages API route, in the shape Anthropic's clients parse.

    {"type": "error", "error": {"type", "message", "code", ...details}}

`error.type` is one of Anthropic's (https://platform.claude.com/docs/en/api/errors), chosen by
the gateway's code; `code` and the details are the gateway's own, as on every other route.
Status, details, Retry-After and the retry advice are the same as on the OpenAI-compatible
routes (api/openai_errors.py): the `anthropic` SDK retries 408, 409, 429 and >= 500 unless the
answer says `x-should-retry: false`, which a spent budget's 402 says besides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from api.openai_errors import refusals_in, shaped_error_response
from core.errors import CeilingError

# The gateway's error code -> Anthropic's error type. Every code api/errors.py knows has one
# (tests/api/test_messages_parts.py): a new code must say how an Anthropic client sees it.
ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "model_unpriced": "invalid_request_error",
    "input_unbounded": "invalid_request_error",
    "model_unbounded": "invalid_request_error",
    "field_unsupported": "invalid_request_error",
    "unauthorized": "authentication_error",
    "forbidden": "permission_error",
    "budget_not_found": "not_found_error",
    "reservation_not_found": "not_found_error",
    "not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "payload_too_large": "request_too_large",
    # Anthropic's own word for an account that cannot pay for the call.
    "budget_exceeded": "billing_error",
    "budget_busy": "rate_limit_error",
    "state_quota": "rate_limit_error",
    "budget_paused": "billing_error",
    "idempotency_conflict": "invalid_request_error",
    "idempotency_in_flight": "invalid_request_error",
    "reply_not_kept": "invalid_request_error",
    "reservation_resolved": "invalid_request_error",
    "operation_refused": "invalid_request_error",
    "budget_in_use": "invalid_request_error",
    "ledger_not_empty": "invalid_request_error",
    "upstream_unreachable": "api_error",
    "upstream_timeout": "timeout_error",
    "upstream_answer_too_large": "api_error",
    "ledger_unavailable": "api_error",
    "ledger_not_shared": "api_error",
    "invalid_configuration": "api_error",
    "invariant_broken": "api_error",
}
# A code not in the table yet (a test names it) still answers in Anthropic's shape.
ANTHROPIC_TYPE_DEFAULT = "api_error"


def anthropic_shape(error: dict[str, Any]) -> dict[str, Any]:
    error = dict(error)
    code = error.pop("code")
    error.pop("type")
    return {"type": "error", "error": {
        "type": ANTHROPIC_TYPES.get(code, ANTHROPIC_TYPE_DEFAULT),
        "message": error.pop("message"), "code": code, **error}}


def anthropic_error_response(exc: CeilingError, headers: Mapping[str, str]) -> JSONResponse:
    return shaped_error_response(exc, headers, anthropic_shape)


def anthropic_error_event(exc: CeilingError) -> bytes:
    """The `error` event a Messages stream already answered 200 ends on: the SDK raises it."""
    body = anthropic_shape({"type": "", "code": exc.code, "message": exc.message,
                            **exc.details})
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


ANTHROPIC_ERRORS = refusals_in(anthropic_error_response)
