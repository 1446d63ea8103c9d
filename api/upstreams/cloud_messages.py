"""Claude's Messages API as the clouds serve it (Bedrock, Vertex): the body they take, the betas
they take, and their errors given Anthropic's shape, so that the anthropic SDK raises them as it
would Anthropic's.

Betas: the clouds serve Claude with fewer `anthropic-beta` flags than Anthropic, some under names
of their own, and fail a call that names one they do not take (Bedrock: 400 "invalid beta
flag"; Vertex: 400 "Unexpected value(s) ... for the anthropic-beta header"). Claude Code sends
Anthropic's set, and pointed at the gateway as at Anthropic it does not trim them for a cloud as
its own Bedrock and Vertex modes do; so the cloud's client sends the cloud's name of each beta
the cloud takes (CLOUD_BETA_NAMES) and leaves the others out. Leaving one out costs nothing the
hold does not cover: every beta a call reaches a cloud with passed the Messages format's check
(core/formats/messages.py MESSAGES_BETAS, or the operator's CEILING_GATEWAY_BETAS_ALLOWED), which
lets through only betas that bill nothing beyond what the body is held at, and the one that
changes rates (the 1M context) is priced, and both clouds take it. A feature a left-out beta
opens is then refused by the cloud, unbilled, which releases the hold.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from core.formats import Plan
from core.upstream import Headers, Sent

# Anthropic's error types by status, for a cloud's error turned into Anthropic's shape: the
# anthropic SDK picks its exception class by status and shows `error.type` and `message`.
ANTHROPIC_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}
# The content type of an Anthropic Messages stream, as Anthropic sends it.
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
BETA_HEADER = "anthropic-beta"
# Anthropic's betas that the clouds name otherwise: advanced tool use is their tool search and
# tool examples betas (Anthropic's tool search page, "on Amazon Bedrock and Google Cloud's
# Vertex AI").
CLOUD_BETA_NAMES: Mapping[str, tuple[str, ...]] = {
    "advanced-tool-use-2025-11-20": ("tool-search-tool-2025-10-19", "tool-examples-2025-10-29"),
}
# The betas each cloud takes for Claude: Bedrock's request-and-response page's list, Vertex's
# Claude page and the feature pages' notes on it; both take Claude Code's identification.
BEDROCK_BETAS = frozenset({
    "computer-use-2024-10-22", "computer-use-2025-01-24", "token-efficient-tools-2025-02-19",
    "interleaved-thinking-2025-05-14", "output-128k-2025-02-19", "dev-full-thinking-2025-05-14",
    "context-1m-2025-08-07", "context-management-2025-06-27", "effort-2025-11-24",
    "tool-search-tool-2025-10-19", "tool-examples-2025-10-29", "claude-code-20250219",
})
VERTEX_BETAS = BEDROCK_BETAS - {"dev-full-thinking-2025-05-14"}
# A Messages body's fields that a cloud reads from elsewhere or that are the cloud client's to
# set, never the client's: the model and the stream (the path names them), the API version, and
# the betas. The gateway checks and prices the `anthropic-beta` header's betas only
# (core/formats/messages.py); a body's `anthropic_beta` (which an operator may let through,
# CEILING_GATEWAY_FIELDS_ALLOWED) was checked by nobody, and one such as the 1M context would
# be billed at rates the hold does not cover: dropped, and the header's betas sent instead.
ENVELOPE_FIELDS = frozenset({"model", "stream", "anthropic_version", "anthropic_beta"})


def header_betas(headers: Headers) -> list[str]:
    """The betas the `anthropic-beta` header (or headers) names, in order."""
    return [beta.strip() for name, value in headers if name.lower() == BETA_HEADER
            for beta in value.split(",") if beta.strip()]


def cloud_body(body: Mapping[str, Any], headers: Headers, anthropic_version: str, *,
               betas_in_body: bool) -> dict[str, Any]:
    """A Messages body as a cloud takes it: without the fields of the cloud's envelope the
    client sent (ENVELOPE_FIELDS), with the cloud's API version, and, `betas_in_body`, the
    `headers`' betas in the body's `anthropic_beta` list (Bedrock reads no beta header)."""
    sent = {key: value for key, value in body.items() if key not in ENVELOPE_FIELDS}
    sent["anthropic_version"] = anthropic_version
    betas = header_betas(headers)
    if betas_in_body and betas:
        sent["anthropic_beta"] = betas
    return sent


def cloud_messages_body(call_plan: Plan, anthropic_version: str, *,
                        betas_in_body: bool) -> tuple[str, bytes]:
    """(the model, the body) of a Messages call as a cloud takes it (cloud_body): the model
    goes in the path, as does the stream."""
    model = str(call_plan.body.get("model", call_plan.model_sent))
    body = cloud_body(call_plan.body, call_plan.headers, anthropic_version,
                      betas_in_body=betas_in_body)
    return model, replace(call_plan, body=body).content()


def anthropic_error(status: int, message: str) -> bytes:
    """An error body in Anthropic's shape, for a cloud's error in its own."""
    return json.dumps({"type": "error", "error": {
        "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500
                                          else "invalid_request_error"),
        "message": message}}).encode()


def error_message(doc: object) -> str | None:
    """The message of a cloud's error body, parsed: AWS's {"message"} ({"Message"} on some),
    Google's {"error": {"message"}}; None for one of neither shape."""
    if not isinstance(doc, dict):
        return None
    inner = doc.get("error")
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return str(inner["message"])
    for key in ("message", "Message"):
        if isinstance(doc.get(key), str):
            return str(doc[key])
    return None


def error_as_anthropic(sent: Sent) -> Sent:
    """An error's Sent with its body in Anthropic's shape (unless it is already), so that the
    anthropic SDK raises it as it would Anthropic's own."""
    assert isinstance(sent[2], bytes)
    try:
        doc = json.loads(sent[2])
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error":
        return sent
    message = (error_message(doc) or sent[2].decode(errors="replace").strip()
               or f"the provider answered {sent[0]}")
    headers = {**sent[1], "content-type": "application/json"}
    return (sent[0], headers, anthropic_error(sent[0], message))


def betas_taken(betas: list[str], taken: frozenset[str]) -> list[str]:
    """`betas` as a cloud that takes `taken` names them, in order, each once; the others left
    out (the module docstring says why that is safe)."""
    named = [cloud for beta in betas for cloud in CLOUD_BETA_NAMES.get(beta, (beta,))]
    return [beta for beta in dict.fromkeys(named) if beta in taken]


def headers_for(headers: Headers, taken: frozenset[str]) -> Headers:
    """The client's forwarded headers with `anthropic-beta` holding the betas a cloud that
    takes `taken` serves (betas_taken), and no such header when none is left."""
    kept = tuple((name, value) for name, value in headers if name.lower() != BETA_HEADER)
    served = betas_taken(header_betas(headers), taken)
    return (*kept, (BETA_HEADER, ",".join(served))) if served else kept
